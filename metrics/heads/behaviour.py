"""What every head does by where it attends: token-based behaviour scores from attention patterns, their
nulls, a head's type and the steps where its type changes over training (docs/measures.md, "Head
behaviours"). The behaviours read from what a head writes are :mod:`metrics.heads.writes`'.

A behaviour is a set of *target keys* for each query, read from the sequence's tokens alone, so the
scores apply to any task, not only the repeated probe. Per sequence ``b`` and query ``q`` with a
non-empty target set ``T_b(q)`` (the query is *defined* for that behaviour)::

    mass_b(q)  = Σ_{k ∈ T_b(q)} pattern[b, h, q, k]
    seq_b      = mean over the defined queries of sequence b of mass_b(q)     # NaN: none defined
    score      = mean over the sequences with a defined query of seq_b        # [..., heads]

The behaviours are the registered ones (:mod:`metrics.heads.behaviours`, one module each; an extension
adds its own), in :func:`behaviour_names` order; the built-in target sets:

- ``previous_token``: ``{q - 1}`` for ``q >= 1``;
- ``current_token``: ``{q}``;
- ``first_token`` (the BOS sink): ``{0}`` for ``q >= 1``;
- ``duplicate_token``: ``{j < q : x_j = x_q}``;
- ``induction`` (prefix matching, Olsson et al. 2022, "In-context Learning and Induction Heads"):
  ``{1 <= j <= q : x_{j-1} = x_q}``, the token after each earlier occurrence of the current token;
- ``statistical_induction`` (Edelman et al. 2024, "The Evolution of Statistical Induction Heads:
  In-Context Learning Markov Chains"): from ``t`` to the positions ``j <= t`` whose previous token
  equals ``x_t``. It is the same target set as ``induction``; the two names say where it is read:
  ``induction`` on the repeated probe (one earlier copy, a deterministic continuation),
  ``statistical_induction`` on a task's own sequences such as Markov chains (many earlier
  occurrences, whose followers are the in-context bigram counts). A type finder is given one of
  the two (:func:`applicable_behaviours`), never both.

With a BOS id, a BOS token is nobody's duplicate or prefix match. Patterns are ``[..., batch, heads,
query, key]`` (rows sum to 1, causal), e.g. ``[layers, batch, heads, query, key]``; tokens ``[batch,
seq]``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from metrics.disk_cache import cache_file, read_json, write_json
from metrics.dynamics.strategy_readings import PERSIST, SWITCH_RESAMPLES, Switch, switches
from metrics.heads.behaviours.base import TokenRelations, behaviour_kinds, behaviours_reading
from models.attention import random_patterns

BUILT_IN_BEHAVIOURS = (
    "previous_token",
    "current_token",
    "first_token",
    "duplicate_token",
    "induction",
    "statistical_induction",
)
"""The stored scores' axis of runs written before it was labelled (the built-in behaviours, in order)."""
PREFIX_MATCHING = ("induction", "statistical_induction")
"""The prefix-matching mask's two names: a run reads the one its task names."""
UNSPECIALISED = "unspecialised"


def behaviour_names() -> tuple[str, ...]:
    """Every registered attention-side behaviour's name (:func:`~metrics.heads.behaviours.base.behaviours_reading`):
    the built-in ones (:data:`BUILT_IN_BEHAVIOURS`), then those of other modules and extensions."""
    return tuple(behaviours_reading("attention"))


def type_names_of(behaviours: Sequence[str]) -> tuple[str, ...]:
    """A head's type names for scores over ``behaviours`` (their last axis): code 0 is unspecialised,
    code ``i + 1`` is ``behaviours[i]``."""
    return (UNSPECIALISED, *behaviours)


def behaviour_colour(name: str) -> str:
    """A behaviour's colour in figures (its class's ``colour``; grey for unspecialised or one not installed)."""
    kind = behaviour_kinds().get(name)
    return kind.colour if kind is not None else "0.8" if name == UNSPECIALISED else "tab:gray"


MIN_Z = 3.0
"""A behaviour types a head only if its score clears the null by more than this many null spreads."""

MIN_EXCESS = 0.2
"""... and by more than this much attention mass: on long sequences the null's spread is small, and a
near-uniform head with a tiny but consistent excess would otherwise clear ``MIN_Z``."""

STD_FLOOR = 0.01
"""Null spreads below this (attention mass) are read as this in a margin: a position behaviour under
the permuted null has spread 0 exactly. A behaviour clearing ``MIN_EXCESS`` has ``z >= 20`` wherever
its spread is under the floor, so the floor never decides a type by itself."""

NULL_DRAWS = 200
"""Random heads (or token permutations) behind a null's mean and spread."""

NULL_LOGIT_STD = 1.0
"""Spread of the random heads' attention logits (:func:`null_from_random_patterns`). The project's
models start near 0.03 (fan-in init, default shape): nearly uniform, whose spread is smaller still;
unit logits stand for a head that has sharpened without learning anything."""


@dataclass(frozen=True)
class BehaviourTargets:
    """Every behaviour's target keys for a token batch, built once: ``masks [behaviours, batch, query,
    key]`` (bool), ``counts [behaviours, batch]``, each sequence's number of defined queries, and the
    behaviours' ``names`` (the masks' first axis: the scores' last)."""

    masks: Tensor
    counts: Tensor
    names: tuple[str, ...]

    @property
    def defined(self) -> Tensor:
        """``[behaviours, batch, query]``: queries with at least one target key."""
        return self.masks.any(-1)

    def weights(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``masks / counts`` ``[behaviours, batch, query, key]``: one contraction with a pattern gives
        each sequence's mean mass over its defined queries."""
        masks = self.masks.to(device=device, dtype=dtype)
        return masks / self.counts.to(device=device, dtype=dtype).clamp_min(1)[..., None, None]


def behaviour_targets(
    tokens: Tensor, bos_id: int | None = None, names: Sequence[str] | None = None
) -> BehaviourTargets:
    """Target masks of the behaviours ``names`` (default: every registered one, :func:`behaviour_names`)
    for ``tokens [batch, seq]`` (the module docstring); with ``bos_id``, BOS tokens never match."""
    names = behaviour_names() if names is None else tuple(names)
    kinds = behaviour_kinds()
    relations = TokenRelations.of(tokens, bos_id)
    masks = torch.stack([kinds[name].targets(relations) for name in names])  # (behaviours, b, query, key)
    return BehaviourTargets(masks, masks.any(-1).sum(-1), names)


def applicable_behaviours(
    targets: BehaviourTargets, prefix_matching: str = "induction", min_queries: int = 1, task: str | None = None
) -> tuple[str, ...]:
    """The behaviours with at least ``min_queries`` defined queries over the batch, in ``targets.names``
    order; of the two prefix-matching names only ``prefix_matching`` (``induction`` on the repeated
    probe, ``statistical_induction`` on a task's own sequences); of the behaviours that name their
    tasks, those that name ``task``. No duplicate or prefix-matching behaviour applies where no token repeats."""
    if prefix_matching not in PREFIX_MATCHING:
        raise ValueError(f"prefix_matching={prefix_matching!r} must be one of {PREFIX_MATCHING}")
    total, kinds = targets.counts.sum(-1), behaviour_kinds()
    return tuple(
        name
        for i, name in enumerate(targets.names)
        if int(total[i]) >= min_queries
        and (name not in PREFIX_MATCHING or name == prefix_matching)
        and (name not in kinds or not kinds[name].tasks or task in kinds[name].tasks)
    )


def per_sequence_scores(pattern: Tensor, targets: BehaviourTargets, weights: Tensor | None = None) -> Tensor:
    """Each sequence's mean mass on its targets over its defined queries: ``pattern [..., batch,
    heads, query, key]`` -> ``[..., batch, heads, behaviours]`` (NaN where a sequence has no defined
    query). ``weights``: ``targets.weights`` in the pattern's dtype and device, where the caller keeps them."""
    weights = targets.weights(pattern.dtype, pattern.device) if weights is None else weights
    *lead, b, h, q, k = pattern.shape
    flat = weights.flatten(2).permute(1, 2, 0)  # (b, q·k, behaviours)
    scores = (pattern.reshape(-1, b, h, q * k) @ flat).reshape(*lead, b, h, -1)  # a batched GEMM per sequence
    defined = (targets.counts > 0).T.to(pattern.device)  # (b, behaviours)
    return torch.where(defined[:, None, :], scores, torch.full_like(scores, float("nan")))


def behaviour_scores(pattern: Tensor, targets: BehaviourTargets) -> Tensor:
    """The module docstring's score of every head and behaviour: ``pattern [..., batch, heads, query,
    key]`` -> ``[..., heads, behaviours]``, the mean of :func:`per_sequence_scores` over the sequences
    where a behaviour is defined (NaN where it is nowhere)."""
    return per_sequence_scores(pattern, targets).nanmean(dim=-3)


@dataclass(frozen=True)
class Null:
    """What a head's scores read when nothing is learnt: ``mean`` and ``std``, broadcastable to the
    scores ``[..., heads, behaviours]`` (``[behaviours]`` for random patterns)."""

    mean: Tensor
    std: Tensor

    def margins(self, scores: Tensor, floor: float = STD_FLOOR) -> Tensor:
        """``(score - mean) / max(std, floor)``: a z-score, ``scores``' shape (:data:`STD_FLOOR`)."""
        return (scores - self.mean) / self.std.clamp_min(floor)


def null_from_random_patterns(
    targets: BehaviourTargets,
    draws: int = NULL_DRAWS,
    logit_std: float = NULL_LOGIT_STD,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Null:
    """Scores of ``draws`` random heads on this batch's targets -> mean and std per behaviour
    ``[behaviours]``. Each head's logits are i.i.d. N(0, ``logit_std``²) for every sequence, query and
    key, then causally softmaxed. The keys are exchangeable, so the mean is uniform causal
    attention's, ``mean |T_b(q)| / (q + 1)``, whatever ``logit_std``; the spread grows with it."""
    b, s = targets.masks.shape[1:3]
    device = targets.masks.device
    generator = torch.Generator(device=device).manual_seed(seed)
    chunk = max(1, 2**22 // (b * s * s))  # draws per chunk: ~4M logits at a time
    scores = []
    for start in range(0, draws, chunk):
        n = min(chunk, draws - start)
        patterns = random_patterns((b, n, s, s), logit_std, generator, dtype, device)  # the same draws as before
        scores.append(behaviour_scores(patterns, targets))  # (n draws as heads, behaviours)
    scores = torch.cat(scores)
    return Null(scores.mean(0), scores.std(0))


NULL_CACHE_VERSION = 1
"""Bump when :func:`null_from_random_patterns` changes, so stale files in the disk cache are not read."""


def cached_random_null(targets: BehaviourTargets, draws: int = NULL_DRAWS, seed: int = 0) -> Null:
    """:func:`null_from_random_patterns` (float64, unit logits) of ``targets``, kept in the disk cache
    (:mod:`metrics.disk_cache`) under a digest of the target masks, their names, ``draws`` and ``seed``:
    a pure function of those, so a run pays for it once per probe and machine (3.9 s on the Markov-chain
    task's 64 x 101 probe, 0.17 s on the default one, on a 2-core machine). ``[behaviours]`` each, on the CPU."""
    masks = targets.masks.cpu().contiguous()
    key = hashlib.sha256(np.packbits(masks.numpy()).tobytes())
    key.update(repr((tuple(masks.shape), targets.names, draws, NULL_LOGIT_STD, seed)).encode())
    path = cache_file("behaviour_nulls", f"v{NULL_CACHE_VERSION}-{key.hexdigest()[:32]}")
    stored = read_json(path)
    if isinstance(stored, dict) and all(len(stored.get(part) or ()) == len(targets.names) for part in ("mean", "std")):
        return Null(*(torch.tensor(stored[part], dtype=torch.float64, device="cpu") for part in ("mean", "std")))
    null = null_from_random_patterns(targets, draws, NULL_LOGIT_STD, seed)
    write_json(path, {"mean": null.mean.tolist(), "std": null.std.tolist()}, "the head behaviours' random null")
    return Null(null.mean.cpu(), null.std.cpu())


def permuted_tokens(tokens: Tensor, generator: torch.Generator, bos_id: int | None = None) -> Tensor:
    """``tokens [batch, seq]`` permuted within each sequence, BOS tokens kept in place."""
    movable = torch.ones_like(tokens, dtype=torch.bool) if bos_id is None else tokens != bos_id
    inf = torch.tensor(float("inf"), device=tokens.device)
    keys = torch.where(movable, torch.rand(tokens.shape, generator=generator, device=tokens.device), inf)
    source = keys.argsort(dim=-1, stable=True)  # movable positions in random order, then the fixed ones
    positions = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens).to(torch.float)
    destination = torch.where(movable, positions, inf).argsort(dim=-1, stable=True)  # the same, in order
    return torch.empty_like(tokens).scatter_(-1, destination, tokens.gather(-1, source))


def null_from_permuted_tokens(
    pattern: Tensor, tokens: Tensor, bos_id: int | None = None, draws: int = NULL_DRAWS, seed: int = 0
) -> Null:
    """The same patterns ``[..., batch, heads, query, key]`` scored against ``tokens [batch, seq]``
    permuted within each sequence (BOS kept in place), ``draws`` times -> mean and std ``[..., heads,
    behaviours]``. It keeps each head's positional profile and breaks its relation to the tokens: a
    token behaviour clears it only if the head attends by content. Position behaviours' targets do
    not move, so their null is the score itself with spread 0 (margin 0): read those against
    :func:`null_from_random_patterns`."""
    generator = torch.Generator(device=tokens.device).manual_seed(seed)
    scores = torch.stack(
        [
            behaviour_scores(pattern, behaviour_targets(permuted_tokens(tokens, generator, bos_id), bos_id))
            for _ in range(draws)
        ]
    )
    return Null(scores.mean(0), scores.std(0))


def head_types(
    scores: Tensor,
    null: Null,
    behaviours: Sequence[str],
    min_z: float = MIN_Z,
    min_excess: float = MIN_EXCESS,
    floor: float = STD_FLOOR,
    names: Sequence[str] | None = None,
) -> Tensor:
    """Each head's type, a code into :func:`type_names_of` ``(names)``: ``scores [..., behaviours]`` (e.g.
    ``[steps, heads, behaviours]``, the heads × steps type map; ``names`` its last axis, default every
    registered behaviour) -> ``[...]`` (long). Among ``behaviours``, those whose score clears the null by
    ``margin > min_z`` and ``score - mean > min_excess``; of these the one with the widest margin; none:
    unspecialised (0). NaN scores (undefined) never type a head."""
    if all(name in behaviours for name in PREFIX_MATCHING):
        raise ValueError(f"{PREFIX_MATCHING} share their targets: give one of them (applicable_behaviours)")
    names = behaviour_names() if names is None else names
    considered = torch.tensor([name in behaviours for name in names], device=scores.device)
    margins = null.margins(scores, floor)
    clears = considered & (margins > min_z) & (scores - null.mean > min_excess)  # NaN compares False
    best = torch.where(clears, margins, torch.full_like(margins, float("-inf"))).argmax(-1)
    return torch.where(clears.any(-1), best + 1, torch.zeros_like(best))


def type_names(codes: Tensor, names: Sequence[str] | None = None) -> np.ndarray:
    """Codes from :func:`head_types` (over behaviours ``names``, default every registered one) -> their
    type names, an array of ``codes``' shape."""
    types = type_names_of(behaviour_names() if names is None else names)
    return np.asarray(types, dtype=object)[codes.cpu().numpy()]


def resampled_scores(per_sequence: Tensor, counts: Tensor) -> Tensor:
    """Batch scores of resampled sequences: ``per_sequence [steps, batch, heads, behaviours]`` (NaN:
    undefined), ``counts [resamples, batch]`` (how often each sequence is drawn) -> ``[resamples,
    steps, heads, behaviours]``, the mean over the drawn sequences where defined."""
    defined = ~per_sequence.isnan()
    counts = counts.to(per_sequence.dtype)
    total = torch.einsum("rb,sbhn->rshn", counts, per_sequence.nan_to_num())
    return total / torch.einsum("rb,sbhn->rshn", counts, defined.to(per_sequence.dtype))  # 0/0: NaN


def type_switches(
    steps: np.ndarray,
    per_sequence: Tensor,
    null: Null,
    behaviours: Sequence[str],
    persist: int = PERSIST,
    resamples: int = SWITCH_RESAMPLES,
    seed: int = 0,
    min_z: float = MIN_Z,
    min_excess: float = MIN_EXCESS,
    names: Sequence[str] | None = None,
) -> list[list[Switch]]:
    """For each head, the steps where its type changes and then holds for ``persist`` snapshots
    (:func:`metrics.dynamics.strategy_readings.switches` on :func:`head_types` of each snapshot's scores, as
    they are: a moving average would date a sharp change early), each with the 2.5-97.5 % range of
    its step over ``resamples`` bootstrap resamples of the batch's sequences and the share of
    resamples that have it (the k-th ``A -> B`` of a resample matched with the k-th of the run, as
    :func:`metrics.dynamics.strategy_readings.switches_with_intervals`). ``steps [n_steps]``, ``per_sequence
    [n_steps, batch, heads, behaviours]`` (:func:`per_sequence_scores` of each snapshot), ``null``
    broadcastable to ``[n_steps, heads, behaviours]`` and held fixed over the resamples; ``names`` the
    scores' last axis (default every registered behaviour)."""
    names = behaviour_names() if names is None else tuple(names)
    types = list(type_names_of(names))
    per_sequence = per_sequence.double()
    rng = np.random.default_rng(seed)
    b = per_sequence.shape[1]
    picks = torch.from_numpy(rng.integers(0, b, size=(resamples, b)))
    counts = torch.zeros(resamples, b, dtype=torch.long, device="cpu").scatter_add_(1, picks, torch.ones_like(picks))
    point = head_types(per_sequence.nanmean(1), null, behaviours, min_z, min_excess, names=names).numpy()
    drawn = head_types(resampled_scores(per_sequence, counts), null, behaviours, min_z, min_excess, names=names)
    drawn = drawn.numpy()  # (resamples, steps, heads)
    result = []
    for h in range(point.shape[1]):
        found = switches(steps, point[:, h], types, persist)
        matched: list[list[float]] = [[] for _ in found]
        for r in range(resamples):
            seen: dict[str, int] = {}
            by_label: dict[tuple[str, int], float] = {}
            for switch in switches(steps, drawn[r, :, h], types, persist):
                seen[switch.label] = seen.get(switch.label, 0) + 1
                by_label[(switch.label, seen[switch.label])] = switch.step
            count: dict[str, int] = {}
            for i, switch in enumerate(found):
                count[switch.label] = count.get(switch.label, 0) + 1
                if (switch.label, count[switch.label]) in by_label:
                    matched[i].append(by_label[(switch.label, count[switch.label])])
        head = []
        for switch, at in zip(found, matched):
            low, high = np.percentile(at, [2.5, 97.5]) if at else (float("nan"), float("nan"))
            head.append(Switch(switch.source, switch.target, switch.step, float(low), float(high), len(at) / resamples))
        result.append(head)
    return result
