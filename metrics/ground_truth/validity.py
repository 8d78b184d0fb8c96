"""Which weight measure tells the truth: agreement of a pair score with the ablation ground truth
(docs/measures.md, "Ground truth: ablation").

A composition measure is a hypothesis about which writer feeds which reader. The K-only path
ablation (:mod:`metrics.ground_truth.ablation`) says which pair the model really uses. Two agreements are
reported at each ablation step: the rank, under the measure, of the pair the ablation hurts most
(1 = the measure puts it first), and the Spearman correlation between measure and effect over
all pairs.

The same two are also read at the level of heads (:func:`head_agreement`): each writer's total
over its readers, of the effect and of the measure alike, and each reader's total over its
writers. Redundant heads make the pair level fragile: when two induction heads read the same
previous-token head, the two pairs' effects can differ by 0.001 and which one the measure ranks
first is a coin flip, while both effects add into the total of the writer they share. So a near-tie
between redundant readers cannot flip the writer level, nor one between redundant writers the
reader level (each level is still as fragile as the pair level to redundancy on its own side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

LEVELS = ("writer", "reader")
"""The head-level readings beside the pair level, in the order they are logged."""


@dataclass(frozen=True)
class Agreement:
    """``rank_of_truth``: 1 + how many items (pairs, or heads at a head level) the measure scores
    strictly above the ground-truth one. ``spearman``: rank correlation over them in [-1, 1]; NaN
    when either side is constant (or there is one item).

    ``writer``, ``reader``: the same two at the head levels (:func:`head_agreement`), attached by
    :func:`agreement` to the pair-level result when the pair tensors split into writer and reader
    axes; None at a head level itself."""

    rank_of_truth: int
    spearman: float
    writer: Agreement | None = None
    reader: Agreement | None = None


def average_ranks(values: Tensor) -> Tensor:
    """Ranks ``1..n`` of ``values [..., n]`` (ascending, along the last axis), ties given their
    average rank, float64.

    Rank of v = (number of values below v) + (number equal to v, itself included, + 1) / 2: for a
    run of ties at sorted positions ``first..last`` (from 0), ``(first + last) / 2 + 1``. By sorting,
    in ``O(n log n)`` time and ``O(n)`` memory (all pairs at 12 × 12 heads are ~10⁴, so a pairwise
    comparison would take ~10⁸ bytes per row).
    """
    ordered, order = values.sort(-1)
    n = values.shape[-1]
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    run = starts.cumsum(-1) - 1  # (..., n): which run of ties each sorted position is in
    position = torch.arange(n, device=values.device).expand_as(run)
    first = torch.full_like(run, n).scatter_reduce(-1, run, position, "amin")
    last = torch.zeros_like(run).scatter_reduce(-1, run, position, "amax")
    sorted_ranks = (first.gather(-1, run) + last.gather(-1, run)).double() / 2 + 1
    return torch.empty_like(sorted_ranks).scatter_(-1, order, sorted_ranks)


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation of two ``[n]`` series: Pearson's r of their average ranks."""
    return float(spearmans(x[None], y)[0])


def spearmans(x: Tensor, y: Tensor) -> Tensor:
    """:func:`spearman` of each row of ``x [m, n]`` with ``y [n]`` -> ``[m]`` float64 (NaN where a side is constant)."""
    rx, ry = average_ranks(x.double()), average_ranks(y.double())
    rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean()
    denominator = (rx.square().sum(-1) * ry.square().sum()).sqrt()
    return torch.where(denominator == 0, math.nan, (rx * ry).sum(-1) / denominator)


def agreement(scores: Tensor, effects: Tensor) -> Agreement:
    """How well ``scores`` predicts ``effects``; both have the same shape, NaN where a pair is masked.

    The ground-truth pair is the one with the largest effect (the ablation hurts it most). With an
    even number of axes (``[L, H, L, H]``: writer axes, then reader axes) the writer- and
    reader-level agreements (:func:`head_agreement`) are attached as ``writer`` and ``reader``;
    the pair-level fields do not depend on them.
    """
    valid = ~(scores.isnan() | effects.isnan())
    levels = {level: head_agreement(scores, effects, level) for level in LEVELS} if scores.dim() % 2 == 0 else {}
    return ranked_agreement(scores[valid], effects[valid], **levels)


def agreements(scorers: dict[str, Tensor], effects: Tensor) -> dict[str, Agreement]:
    """:func:`agreement` of every scorer with the same ``effects``, batched over the scorers: one
    snapshot judges ~10 measures against each effect, and on small models the per-call cost of the
    ranking ops, not their arithmetic, is what it pays. Scorers whose NaN masks differ from the
    first's are judged one by one (the same result)."""
    names = list(scorers)
    if not names:
        return {}
    stack = torch.stack([scorers[name] for name in names])  # (m, *shape)
    valid = ~(stack.isnan() | effects.isnan())
    if effects.dim() % 2 or not bool((valid == valid[0]).all()) or not bool(valid[0].any()):
        return {name: agreement(scorers[name], effects) for name in names}
    pair = ranked_agreements(stack[:, valid[0]], effects[valid[0]])
    levels = {level: ranked_agreements(*batched_head_totals(stack, effects, level)) for level in LEVELS}
    return {
        name: Agreement(pair[i].rank_of_truth, pair[i].spearman, **{level: levels[level][i] for level in LEVELS})
        for i, name in enumerate(names)
    }


def ranked_agreements(s: Tensor, e: Tensor) -> list[Agreement]:
    """:func:`ranked_agreement` of each row of ``s [m, n]`` with ``e [n]`` (no NaN)."""
    truth = int(e.argmax())
    ranks = 1 + (s > s[:, truth, None]).sum(-1)
    return [Agreement(int(rank), float(rho)) for rank, rho in zip(ranks.tolist(), spearmans(s, e).tolist())]


def ranked_agreement(s: Tensor, e: Tensor, **levels: Agreement) -> Agreement:
    """:class:`Agreement` of scores ``s [n]`` with effects ``e [n]`` (no NaN): the truth is ``e``'s largest."""
    if len(s) == 0:
        raise ValueError("no scored pair: the model needs at least two layers")
    truth = int(e.argmax())
    return Agreement(rank_of_truth=1 + int((s > s[truth]).sum()), spearman=spearman(s, e), **levels)


def head_totals(scores: Tensor, effects: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """Each head's total score and total effect at ``level`` (``"writer"`` or ``"reader"``),
    float64, over the pairs where both are defined; heads with no such pair are left out.

    ``scores, effects``: the same shape with an even number of axes, the first half indexing the
    writer (``[L, H, L, H]``: writer layer and head, reader layer and head). A writer's totals sum
    over its readers, a reader's over its writers. Returns ``(score_totals [n], effect_totals [n])``
    for the ``n`` heads kept, in flat head order (``layer * n_heads + head``).
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if scores.shape != effects.shape or scores.dim() % 2:
        raise ValueError(
            f"need two tensors of one shape with writer and reader axes, got {tuple(scores.shape)}, {tuple(effects.shape)}"
        )
    totals, effect_totals = batched_head_totals(scores[None], effects, level)
    return totals[0], effect_totals


def batched_head_totals(scores: Tensor, effects: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """:func:`head_totals` of each of ``scores [m, *shape]`` with ``effects [*shape]``, all with one NaN
    mask: ``(score_totals [m, n], effect_totals [n])``."""
    split = effects.dim() // 2
    n_writers = math.prod(effects.shape[:split])
    s, e = scores.reshape(len(scores), n_writers, -1).double(), effects.reshape(n_writers, -1).double()
    if level == "reader":
        s, e = s.mT, e.T
    valid = ~(s[0].isnan() | e.isnan())
    kept = valid.any(1)
    return s.masked_fill(~valid, 0.0).sum(-1)[:, kept], e.masked_fill(~valid, 0.0).sum(-1)[kept]


def head_agreement(scores: Tensor, effects: Tensor, level: str) -> Agreement:
    """:func:`agreement` over heads instead of pairs: ``"writer"`` ranks the writers by their
    summed effect over all their readers, ``"reader"`` the readers by their summed effect over
    all their writers (:func:`head_totals`; pairs masked on either side are left out of both sums).

    The measure is summed the same way, not maxed: the ground truth is a sum, so like is compared
    with like, and a measure that equals the effect on every pair agrees perfectly at every level
    (a max would rank a writer with one strong reader above one with several slightly weaker ones,
    where the summed ablation does the opposite). The ground-truth head is the one with the largest
    total effect; ``rank_of_truth`` is 1 + the number of heads whose total score is strictly higher.
    """
    return ranked_agreement(*head_totals(scores, effects, level))


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
