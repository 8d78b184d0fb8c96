"""The empirical random baseline of a composition measure (Elhage et al. 2021 "subtract off the
empirical expected amount for random matrices of the same shapes").

Writers ``W_V [d_model, d_head]``, ``W_O [d_head, d_model]`` and readers ``W_Q, W_K`` are i.i.d.
Gaussian; the baseline is the mean score with its standard error. For i.i.d. Gaussian factors Q-,
K- and V-composition have the same distribution (every reader is a product of two independent
Gaussian ``d_model x d_head`` factors), so one baseline per measure and shape serves all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from metrics.composition.circuits import LowRank
from metrics.composition.measures import PairMeasure


@dataclass(frozen=True)
class Baseline:
    mean: float
    stderr: float
    n_samples: int


def random_low_rank(n: int, d_model: int, d_head: int, generator: torch.Generator) -> LowRank:
    """``n`` products of two i.i.d. standard Gaussian ``[d_model, d_head]`` factors, float64."""
    draw = lambda: torch.randn(n, d_model, d_head, generator=generator, dtype=torch.float64)
    return LowRank(draw(), draw())


@lru_cache(maxsize=None)
def random_baseline(measure: PairMeasure, d_model: int, d_head: int, n_samples: int = 2000, seed: int = 0) -> Baseline:
    """Mean and standard error of ``measure`` over ``n_samples`` random writer/reader pairs.

    Cached per (measure, shape, samples, seed); uses its own generator, never the global RNG.
    """
    generator = torch.Generator().manual_seed(seed)
    writers = random_low_rank(n_samples, d_model, d_head, generator)
    readers = random_low_rank(n_samples, d_model, d_head, generator)
    scores = measure(writers, readers)
    return Baseline(scores.mean().item(), (scores.std() / n_samples**0.5).item(), n_samples)
