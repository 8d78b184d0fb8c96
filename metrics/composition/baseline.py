"""The random baseline of each composition measure (Elhage et al. 2021: "subtract off the empirical
expected amount for random matrices of the same shapes"), sampled in ``d_head`` space and cached on disk.

Writers ``A = L_a R_aᵀ`` and readers ``B = L_b R_bᵀ`` have i.i.d. standard Gaussian factors
``[d_model, d_head]``. Every measure depends on a pair only through ``σ(A)``, ``σ(B)`` and the
cosines ``U_Aᵀ V_B`` (:mod:`metrics.composition.measures`), and for Gaussian factors these have
``d_head``-sized laws, so the baseline never draws a ``d_model``-sized matrix:

- The QR triangle of a Gaussian ``[d, r]`` matrix is Bartlett's (independent ``χ_{d-i}`` diagonal,
  standard normal above it) and independent of its orthonormal factor, so ``σ(A) = σ(T_{L_a} T_{R_a}ᵀ)``
  with two Bartlett triangles, and likewise ``σ(B)``.
- ``U_Aᵀ V_B = W_Aᵀ (Q_{R_a}ᵀ Q_{L_b}) P_B`` where the middle is the ``r x r`` block of a Haar
  orthogonal ``d x d`` matrix, independent of the triangles and invariant under the rotations
  ``W_A, P_B``: so the cosines are that block, independent of both spectra. With ``Q_{R_a}`` the
  first ``r`` axes, the block is ``G_top T_G^{-1}`` for a Gaussian ``G = [G_top; G_bot]``
  (``r`` and ``d - r`` rows) whose Gram ``G_topᵀ G_top + G_botᵀ G_bot`` needs ``G_bot`` only through
  a Bartlett triangle of ``d - r`` degrees of freedom.

A sample costs ``O(d_head³)`` instead of ``O(d_model d_head²)``. For i.i.d. Gaussian factors Q-, K-
and V-composition have the same law, so one baseline per measure and shape serves all three; the
whitened measures (``token_space`` too) share Frobenius's (Gaussian weights are isotropic already).
Results are cached in-process and on disk (:mod:`metrics.disk_cache`), keyed by (d_model, d_head,
samples, seed, sampler version), written atomically so concurrent sweep jobs can share the cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from metrics.composition.measures import WEIGHT_MEASURES, PairStats, stats_from_cosines
from metrics.disk_cache import cache_file, read_json, write_json

BASELINE_SAMPLES = 2000  # random head pairs a baseline is the mean of (tracker.baseline_samples)
SAMPLER_VERSION = 1  # bump when the sampler changes, so stale cache files are not read


@dataclass(frozen=True)
class Baseline:
    mean: float
    stderr: float
    n_samples: int


def bartlett_triangles(rng: np.random.Generator, n: int, d: int, r: int) -> torch.Tensor:
    """``n`` upper-triangular ``[r, r]`` QR triangles of i.i.d. standard Gaussian ``[d, r]`` matrices
    (Bartlett decomposition; needs ``d >= r``): diagonal ``sqrt(χ²_{d-i})``, above it ``N(0, 1)``."""
    triangles = np.triu(rng.standard_normal((n, r, r)), k=1)
    diagonal = np.sqrt(rng.chisquare(d - np.arange(r), size=(n, r)))
    triangles[:, np.arange(r), np.arange(r)] = diagonal
    return torch.from_numpy(triangles)


def gaussian_gram(rng: np.random.Generator, n: int, rows: int, r: int) -> torch.Tensor:
    """``n`` Gram matrices ``GᵀG`` ``[r, r]`` of Gaussian ``[rows, r]`` matrices (Wishart), from a
    Bartlett triangle when ``rows >= r``, else from the matrix itself (then cheaper)."""
    if rows >= r:
        t = bartlett_triangles(rng, n, rows, r)
    else:
        t = torch.from_numpy(rng.standard_normal((n, rows, r)))
    return t.mT @ t


def squared_spectrum(rng: np.random.Generator, n: int, d: int, r: int) -> torch.Tensor:
    """``σ(L Rᵀ)²`` ``[n, r]``, descending, for i.i.d. Gaussian ``L, R [d, r]``."""
    core = bartlett_triangles(rng, n, d, r) @ bartlett_triangles(rng, n, d, r).mT
    return torch.linalg.eigvalsh(core @ core.mT).flip(-1).clamp_min(0)


def haar_block(rng: np.random.Generator, n: int, d: int, r: int) -> torch.Tensor:
    """``n`` ``[r, r]`` blocks of Haar-random orthogonal ``d x d`` matrices: the cosines between two
    independent uniformly random ``r``-dimensional subspaces of ``R^d``."""
    top = torch.from_numpy(rng.standard_normal((n, r, r)))
    gram = top.mT @ top
    if d > r:
        gram = gram + gaussian_gram(rng, n, d - r, r)
    upper = torch.linalg.cholesky(gram).mT  # T_G, with T_Gᵀ T_G = GᵀG
    return torch.linalg.solve_triangular(upper, top, upper=True, left=False)  # G_top T_G⁻¹


def sample_pair_stats(d_model: int, d_head: int, n_samples: int, seed: int = 0) -> PairStats:
    """:class:`PairStats` ``[n_samples, ...]`` of random writer/reader pairs, exact in law to i.i.d.
    Gaussian ``[d_model, d_head]`` factors, float64. Uses its own generator, never the global RNG."""
    if d_head > d_model:
        raise ValueError(f"d_head={d_head} must be <= d_model={d_model}")
    rng = np.random.default_rng(seed)
    writer_sq = squared_spectrum(rng, n_samples, d_model, d_head)
    reader_sq = squared_spectrum(rng, n_samples, d_model, d_head)
    return stats_from_cosines(haar_block(rng, n_samples, d_model, d_head), writer_sq, reader_sq)


def _cache_file(d_model: int, d_head: int, n_samples: int, seed: int) -> Path:
    return cache_file("baselines", f"v{SAMPLER_VERSION}-d{d_model}-r{d_head}-n{n_samples}-seed{seed}")


def _read_cache(path: Path) -> dict[str, Baseline] | None:
    stored = read_json(path)
    try:
        return None if stored is None else {name: Baseline(**values) for name, values in stored.items()}
    except (AttributeError, TypeError):
        return None  # not a file of baselines: recompute


def _summarise(scores: torch.Tensor) -> Baseline:
    scores = scores[scores.isfinite()]
    n = len(scores)
    return Baseline(scores.mean().item(), (scores.std() / math.sqrt(n)).item() if n > 1 else math.nan, n)


def random_baselines(
    d_model: int, d_head: int, n_samples: int = BASELINE_SAMPLES, seed: int = 0
) -> dict[str, Baseline]:
    """Every weight-based measure's baseline (mean and standard error over ``n_samples`` random
    pairs), by name: in-process cache, then the disk cache, then one sampling pass shared by all
    measures (again when a measure registered since is missing from the disk cache)."""
    return _baselines(d_model, d_head, n_samples, seed, tuple(WEIGHT_MEASURES))


@cache
def _baselines(d_model: int, d_head: int, n_samples: int, seed: int, names: tuple[str, ...]) -> dict[str, Baseline]:
    path = _cache_file(d_model, d_head, n_samples, seed)
    cached = _read_cache(path)
    if cached is not None and set(names) <= set(cached):
        return {name: cached[name] for name in names}
    stats = sample_pair_stats(d_model, d_head, n_samples, seed)
    baselines = {name: _summarise(WEIGHT_MEASURES[name].score(stats)) for name in names}
    write_json(path, {name: asdict(b) for name, b in {**(cached or {}), **baselines}.items()}, "random baselines")
    return baselines


random_baselines.cache_clear = _baselines.cache_clear  # forget the in-process cache (the tests' disk-cache checks)
