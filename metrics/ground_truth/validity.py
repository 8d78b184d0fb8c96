"""Which weight measure tells the truth: agreement of a pair score with the ablation ground truth
(docs/measures.md, "Ground truth: ablation"; issue 3, part 4).

A composition measure is a hypothesis about which writer feeds which reader. The K-only path
ablation (:mod:`metrics.ground_truth.ablation`) says which pair the model really uses. Two agreements are
reported at each ablation step: the rank, under the measure, of the pair the ablation hurts most
(1 = the measure puts it first), and the Spearman correlation between measure and effect over
all pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Agreement:
    """``rank_of_truth``: 1 + how many pairs the measure scores strictly above the ground-truth pair.
    ``spearman``: rank correlation over pairs in [-1, 1]; NaN when either side is constant."""

    rank_of_truth: int
    spearman: float


def average_ranks(values: Tensor) -> Tensor:
    """Ranks ``1..n`` of ``values [n]`` (ascending), ties given their average rank, float64.

    Rank of v = (number of values below v) + (number equal to v, itself included, + 1) / 2.
    """
    below = (values[None, :] < values[:, None]).sum(1)
    equal = (values[None, :] == values[:, None]).sum(1)
    return below.double() + (equal.double() + 1) / 2


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation of two ``[n]`` series: Pearson's r of their average ranks."""
    rx, ry = average_ranks(x.double()), average_ranks(y.double())
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    return float("nan") if denominator == 0 else float((rx * ry).sum() / denominator)


def agreement(scores: Tensor, effects: Tensor) -> Agreement:
    """How well ``scores`` predicts ``effects``; both have the same shape, NaN where a pair is masked.

    The ground-truth pair is the one with the largest effect (the ablation hurts it most).
    """
    valid = ~(scores.isnan() | effects.isnan())
    s, e = scores[valid], effects[valid]
    if len(s) == 0:
        raise ValueError("no scored pair: the model needs at least two layers")
    truth = int(e.argmax())
    return Agreement(rank_of_truth=1 + int((s > s[truth]).sum()), spearman=spearman(s, e))


def first_step_ranked_first_for_good(steps: Tensor, ranks: Tensor) -> float | None:
    """The first step from which ``ranks`` is 1 at every later logged step, or None if the last is not.

    ``steps, ranks [n]`` in step order; NaN ranks (not measured) are skipped.
    """
    keep = ~ranks.isnan()
    steps, ranks = steps[keep], ranks[keep]
    if len(ranks) == 0 or ranks[-1] != 1:
        return None
    not_first = torch.nonzero(ranks != 1).flatten()
    start = 0 if len(not_first) == 0 else int(not_first[-1]) + 1
    return float(steps[start])
