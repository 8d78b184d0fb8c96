"""Stable, ``/``-namespaced metric keys, and the flattening of a snapshot into them.

A snapshot holds tensors over every (writer, reader) head pair: ``[L, H, L, H]``, NaN where the
reader's layer is not later, so ``P = H² L (L - 1) / 2`` scored pairs. One key per pair is what a
person wants on a small model and unusable on a big one (20,736 pair keys per snapshot at 4 × 8 with
the eight weight-based measures and the share, 513,216 at 12 × 12: :func:`pair_key_count`, checked
in tests/records/test_keys.py), so :func:`snapshot_metrics` has two modes.

Pair names are ``L0H1->L1H3`` (writer -> reader). Flat head indices are ``layer * n_heads + head``.

Always emitted (when the snapshot part is present; a ``None`` part emits no keys)
----------------------------------------------------------------------------------
``loss/{first_occurrence,repeated,icl_score}``
    loss views on the probe batch
``comp/baseline/{measure}``, ``comp/baseline/{measure}_stderr``
    the measure's random baseline and its standard error
``circuit/K/{measure}``, ``circuit/K/{measure}_minus_baseline``, ``circuit/K/{measure}_minus_baseline_rank``
    the circuit pair's K-composition, raw, minus baseline, its rank among all pairs (1 = top); the
    data-aware share has no baseline: ``circuit/K/share`` only
``circuit/share/{Q,K,V}/{tokens,positions,biases}``
    what the circuit's reader reads besides the heads' writes: those parts' shares (with the share)
``circuit/{writer,reader}_{layer,head}``
    which heads the circuit pair is
``circuit/match``, ``circuit/ablation/{loss_change,pattern_change}``
    the circuit pair's matching score and ablation effects (when those parts ran)
``validity/{loss_change,pattern_change}/{measure or match}/{rank_of_truth,spearman}``
    agreement with the ablation over pairs (``spearman`` left out when undefined)
``validity/loss_change/{measure or match}/{writer,reader}_{rank_of_truth,spearman}``
    the same over writers (each summed over its readers) and over readers (summed over writers),
    for the loss effect only (``HEAD_LEVEL_EFFECTS``)
``heads/{induction,prev_token,duplicate,copying,copying_empirical,copying_top_rate}/top``
    the best head's score

Per-pair mode: while the per-pair keys number at most ``max_pair_keys`` (the default 300)
------------------------------------------------------------------------------------------
Each pair costs ``6M + 3S + 3`` keys (M measures with a baseline: Q, K, V raw and minus baseline;
S without, the share: Q, K, V raw; matching; two ablation effects), so with the eight weight-based
measures and the share the default 2 × 2 model (4 pairs, 216 keys) logs every pair and 2 × 8 (64
pairs, 3,456 keys) logs the summary.

``comp/{Q,K,V}/{measure}/L0H1->L1H3``, ``comp/{Q,K,V}/{measure}_minus_baseline/L0H1->L1H3``
    composition of every pair, raw and minus the baseline
``match/L0H1->L1H3``
    QK matching score of every pair
``ablation/{loss_change,pattern_change}/L0H1->L1H3``
    K-only path ablation effect of every pair

Summary mode: beyond that
-------------------------
``comp/{Q,K,V}/{measure}/{max,mean}``, ``comp/{Q,K,V}/{measure}_minus_baseline/{max,mean}``
    over the scored pairs: each per-pair family becomes its max and mean
``top/K/{measure}/{i}``, ``top/K/{measure}/{i}/writer``, ``top/K/{measure}/{i}/reader``
    the i-th highest K-composition (i = 1 .. ``top_pairs``), raw, and its pair as flat head indices
``match/{max,mean}``, ``top/match/{i}`` (+ ``/writer``, ``/reader``)
    the matching score likewise
``ablation/{effect}/{max,mean}``, ``top/ablation/{effect}/{i}`` (+ ``/writer``, ``/reader``)
    the ablation effects likewise

Head scores
-----------
``heads/{score}/L1H3`` for every head while ``L * H <= max_head_keys``; beyond it
``heads/{score}/top_head`` instead: the best head as a flat index.

Counts (M measures with a baseline, S shares, ``top_pairs`` T = 3, 2 ablation effects, 3 kinds)
-----------------------------------------------------------------------------------------------
summary mode: ``3 + 2M + 12M + 9M + (3M + 4) + 12 + 24 + 8(M + 1)`` = 323 at M = 8, and
``6S + 9S + S + 8S + 9`` = 33 more with the share (its max and mean, top pairs, circuit key,
validity, and the circuit reader's 9 part shares); plus the head keys: ``6 (L H + 1)`` while per
head (at most 198, at 32 heads), else 12. So at most 554 keys for any shape with the defaults;
368 at 12 × 12. The validity keys are ``8(M + S + 1)`` (every measure + match): rank and Spearman
over pairs for 2 effects, and over writers and over readers for the loss effect; an undefined
Spearman is one key fewer.
per-pair mode: ``P (6M + 3S + 3) <= max_pair_keys`` pair keys besides the others: 386 keys in all
for the default 2 × 2 model with the defaults and the ablation.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only for annotations: the keys and the store import nothing heavier than numpy
    from metrics.snapshot import Snapshot

HEAD_SCORES = {
    "induction": "induction",
    "prev_token": "previous_token",
    "duplicate": "duplicate_token",
    "copying": "copying",
    "copying_empirical": "empirical_copying",
    "copying_top_rate": "copying_top_rate",
}
"""Key under ``heads/`` -> the Snapshot attribute holding that ``[L, H]`` score."""

INTERVENTION_OFF = "intervention_off/"
"""Prefix of the scores measured with a run's training-time interventions off (``loss/repeated``,
``heads/prev_token/top``, ``heads/induction/top``), logged at the snapshots where one is on."""

HEAD_LEVEL_EFFECTS = ("loss_change",)
"""Ablation effects whose writer- and reader-level agreement is logged (the validity table reads
only these); 4 keys per scorer and effect, so the pattern effect's would cost 4(M + 1) more."""

KINDS_RANKED = "K"
"""The kind whose top pairs are named in summary mode: K-composition is what induction heads use."""


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def pair_name(writer: tuple[int, int], reader: tuple[int, int]) -> str:
    return f"{head_name(*writer)}->{head_name(*reader)}"


def scored_pair_count(n_layers: int, n_heads: int) -> int:
    """Pairs with the reader in a later layer: ``H² L (L - 1) / 2``."""
    return n_heads * n_heads * n_layers * (n_layers - 1) // 2


def pair_key_count(n_pairs: int, n_measures: int, n_shares: int = 0) -> int:
    """Keys one snapshot spends on pairs in per-pair mode: ``6M + 3S + 3`` per pair (``M`` measures
    with a baseline, ``S`` without: the data-aware share)."""
    return n_pairs * (6 * n_measures + 3 * n_shares + 3)


def snapshot_metrics(
    snap: Snapshot,
    max_pair_keys: int = 300,
    top_pairs: int = 3,
    max_head_keys: int = 32,
    measures: tuple[str, ...] | None = None,
) -> dict[str, float]:
    """Every key of ``snap`` (see the module docstring): one key per pair while those keys number at
    most ``max_pair_keys`` (:func:`pair_key_count`), else per-family max/mean, the ``top_pairs`` best pairs and the
    circuit pair. Per-head keys while the model has at most ``max_head_keys`` heads. Masked (NaN)
    pairs are never emitted; ``None`` parts of the snapshot emit nothing. ``measures``: the measures
    a run tracks (default: those in ``snap``), so that a snapshot scoring only some of them (the
    whitened ones have their own schedule) keeps the run's mode, per pair or summary."""
    metrics: dict[str, float] = {}
    for key, value in (
        ("loss/first_occurrence", snap.first_occurrence_loss),
        ("loss/repeated", snap.repeated_loss),
        ("loss/icl_score", snap.icl_score),
    ):
        if value is not None:
            metrics[key] = float(value)
    for key, attribute in HEAD_SCORES.items():
        scores = getattr(snap, attribute)
        if scores is not None:
            metrics.update(head_metrics(f"heads/{key}", _as_numpy(scores), max_head_keys))
    shape = _pair_shape(snap)
    if shape is not None:
        from metrics.composition.data_shares import DATA_MEASURES  # torch: only with a snapshot to flatten

        tracked = tuple(snap.composition) if measures is None else measures
        shares = sum(m in DATA_MEASURES for m in tracked)
        per_pair = pair_key_count(scored_pair_count(*shape), len(tracked) - shares, shares) <= max_pair_keys
        families = PairFamilies(per_pair, top_pairs, snap.circuit)
        metrics.update(composition_metrics(snap, families))
        if snap.matching is not None:
            metrics.update(families.metrics("match", _as_numpy(snap.matching), "match", "top/match"))
        if snap.ablation is not None:
            for effect, values in snap.ablation.effects().items():
                metrics.update(
                    families.metrics(
                        f"ablation/{effect}", _as_numpy(values), f"ablation/{effect}", f"top/ablation/{effect}"
                    )
                )
    metrics.update(validity_metrics(snap))
    if snap.circuit is not None and snap.share_parts is not None:
        metrics.update(share_part_metrics(snap.share_parts, snap.circuit[1]))
    if snap.circuit is not None:
        (l1, h1), (l2, h2) = snap.circuit
        metrics.update(
            {
                "circuit/writer_layer": l1,
                "circuit/writer_head": h1,
                "circuit/reader_layer": l2,
                "circuit/reader_head": h2,
            }
        )
    return metrics


def share_part_metrics(parts, reader: tuple[int, int]) -> dict[str, float]:
    """``circuit/share/{Q,K,V}/{tokens,positions,biases}``: the share of each part other than the
    heads in what the circuit's reader reads (what the writer's share leaves)."""
    layer, head = reader
    return {
        f"circuit/share/{kind}/{part}": float(getattr(parts, part)[kind][layer, head])
        for kind in parts.heads
        for part in ("tokens", "positions", "biases")
    }


def head_metrics(prefix: str, scores: np.ndarray, max_head_keys: int) -> dict[str, float]:
    """``scores [L, H]`` -> ``{prefix}/L1H3`` per head (NaN left out) and ``{prefix}/top``; with more
    than ``max_head_keys`` heads ``{prefix}/top_head`` (flat index) instead of the per-head keys."""
    flat = scores.reshape(-1)
    if np.isnan(flat).all():
        return {}
    best = int(np.nanargmax(flat))
    metrics = {f"{prefix}/top": float(flat[best])}
    if flat.size > max_head_keys:
        metrics[f"{prefix}/top_head"] = best
        return metrics
    keys = _head_keys(prefix, *scores.shape)
    metrics.update(_without_nan(keys, flat.tolist()))
    return metrics


class PairFamilies:
    """Flattens one ``[L, H, L, H]`` pair tensor into its keys, in either mode.

    ``per_pair``: one key per scored pair; else max and mean over pairs, plus (when asked) the
    circuit pair's value and the ``top_pairs`` best pairs."""

    def __init__(self, per_pair: bool, top_pairs: int, circuit) -> None:
        self.per_pair = per_pair
        self.top_pairs = top_pairs
        self.circuit = circuit

    def metrics(
        self, prefix: str, values: np.ndarray, circuit_key: str | None = None, top_prefix: str | None = None
    ) -> dict[str, float]:
        """``values [L, H, L, H]`` under ``prefix``; the circuit pair's value under ``circuit/{circuit_key}``
        in both modes (the story a reader looks for first); ``top_prefix`` only in summary mode."""
        L, H = values.shape[:2]
        metrics = {}
        if circuit_key is not None and self.circuit is not None:
            (l1, h1), (l2, h2) = self.circuit
            value = float(values[l1, h1, l2, h2])
            if value == value:
                metrics[f"circuit/{circuit_key}"] = value
        if self.per_pair:
            metrics.update(
                _without_nan(_pair_keys(prefix, L, H), values.reshape(-1)[scored_flat_indices(L, H)].tolist())
            )
            return metrics
        scored = values.reshape(-1)[scored_flat_indices(L, H)]
        scored = scored[~np.isnan(scored)]
        if scored.size == 0:
            return {}
        metrics.update({f"{prefix}/max": float(scored.max()), f"{prefix}/mean": float(scored.mean())})
        if top_prefix is not None:
            metrics.update(top_pair_metrics(top_prefix, values, self.top_pairs))
        return metrics


def top_pair_metrics(prefix: str, values: np.ndarray, count: int) -> dict[str, float]:
    """The ``count`` highest non-NaN entries of ``values [L, H, L, H]``: ``{prefix}/{i}`` (1 = best)
    and ``{prefix}/{i}/writer``, ``/reader`` as flat head indices. Ties go to the lower flat pair index."""
    L, H = values.shape[:2]
    flat = values.reshape(-1)
    candidates = np.flatnonzero(~np.isnan(flat))
    count = min(count, candidates.size)
    if count == 0:
        return {}
    scores = flat[candidates]
    if count < candidates.size:  # partial selection: O(pairs), not a sort of every pair
        keep = np.argpartition(-scores, count - 1)[:count]
        candidates, scores = candidates[keep], scores[keep]
    order = np.lexsort((candidates, -scores))[:count]
    metrics = {}
    for rank, (pair, value) in enumerate(zip(candidates[order].tolist(), scores[order].tolist()), start=1):
        writer, reader = divmod(pair, L * H)  # [L, H, L, H] row-major: pair = writer * (L H) + reader
        metrics[f"{prefix}/{rank}"] = value
        metrics[f"{prefix}/{rank}/writer"] = writer
        metrics[f"{prefix}/{rank}/reader"] = reader
    return metrics


def composition_metrics(snap: Snapshot, families: PairFamilies) -> dict[str, float]:
    """``comp/`` keys of every measure and kind, ``comp/baseline/`` and ``circuit/K/`` keys, and in
    summary mode ``top/K/`` keys."""
    metrics: dict[str, float] = {}
    for measure, by_kind in (snap.composition or {}).items():
        baseline = snap.baselines.get(measure) if snap.baselines else None
        if baseline is not None:
            metrics[f"comp/baseline/{measure}"] = baseline.mean
            metrics[f"comp/baseline/{measure}_stderr"] = baseline.stderr
        raw = {kind: _as_numpy(scores) for kind, scores in by_kind.items() if scores is not None}
        for kind, scores in raw.items():
            top = f"top/{kind}/{measure}" if kind == KINDS_RANKED else None
            metrics.update(families.metrics(f"comp/{kind}/{measure}", scores, top_prefix=top))
            if baseline is not None:
                metrics.update(families.metrics(f"comp/{kind}/{measure}_minus_baseline", scores - baseline.mean))
        if snap.circuit is not None and "K" in raw:
            (l1, h1), (l2, h2) = snap.circuit
            circuit_k = raw["K"][l1, h1, l2, h2]  # a numpy scalar: minus the baseline in the tensor's precision
            metrics[f"circuit/K/{measure}"] = float(circuit_k)
            if baseline is not None:
                metrics[f"circuit/K/{measure}_minus_baseline"] = float(circuit_k - baseline.mean)
                metrics[f"circuit/K/{measure}_minus_baseline_rank"] = float(snap.pair_rank(measure, "K", snap.circuit))
    return metrics


def validity_metrics(snap: Snapshot) -> dict[str, float]:
    """``validity/{effect}/{measure}/{rank_of_truth,spearman}`` (pair level) and, for the effects in
    ``HEAD_LEVEL_EFFECTS`` when the agreement carries them, the head levels
    ``.../{writer,reader}_{rank_of_truth,spearman}``; an undefined (NaN) Spearman is left out."""
    metrics: dict[str, float] = {}
    for effect, by_measure in (snap.validity or {}).items():
        for measure, agreed in by_measure.items():
            levels = [("", agreed)]
            if effect in HEAD_LEVEL_EFFECTS:
                levels += [(f"{level}_", getattr(agreed, level, None)) for level in ("writer", "reader")]
            for prefix, level in levels:
                if level is None:
                    continue
                metrics[f"validity/{effect}/{measure}/{prefix}rank_of_truth"] = float(level.rank_of_truth)
                if level.spearman == level.spearman:  # undefined (NaN) when a side is constant
                    metrics[f"validity/{effect}/{measure}/{prefix}spearman"] = level.spearman
    return metrics


def _pair_shape(snap: Snapshot) -> tuple[int, int] | None:
    """``(n_layers, n_heads)`` from the first pair tensor present, None when there is none."""
    candidates = [s for by_kind in (snap.composition or {}).values() for s in by_kind.values()]
    candidates += [snap.matching] + (list(snap.ablation.effects().values()) if snap.ablation is not None else [])
    for tensor in candidates:
        if tensor is not None:
            return tuple(tensor.shape[:2])
    return None


def _as_numpy(values) -> np.ndarray:
    """A CPU numpy copy of a tensor (or an array as is), in its own precision if numpy has it
    (float32, float64), else float32 (numpy has no bfloat16)."""
    if not hasattr(values, "detach"):
        return np.asarray(values)
    values = values.detach()
    if values.is_floating_point() and values.element_size() < 4:  # float16, bfloat16
        values = values.float()
    return values.cpu().numpy()


def _without_nan(keys: tuple[str, ...], values: list[float]) -> dict[str, float]:
    return {key: value for key, value in zip(keys, values) if value == value}


@cache
def scored_flat_indices(n_layers: int, n_heads: int) -> np.ndarray:
    """Flat indices into ``[L, H, L, H]`` of the pairs whose reader layer is later, row-major."""
    layer = np.arange(n_layers)
    later = np.broadcast_to(layer[None, None, :, None] > layer[:, None, None, None], (n_layers, n_heads) * 2)
    return np.flatnonzero(later)


@cache
def _pair_keys(prefix: str, n_layers: int, n_heads: int) -> tuple[str, ...]:
    """``{prefix}/L0H1->L1H3`` for every scored pair, in :func:`scored_flat_indices` order; built
    once per prefix and shape, since a run flattens hundreds of snapshots of one shape."""
    heads = [head_name(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    readers_per_writer = n_layers * n_heads
    return tuple(
        f"{prefix}/{heads[i // readers_per_writer]}->{heads[i % readers_per_writer]}"
        for i in scored_flat_indices(n_layers, n_heads).tolist()
    )


@cache
def _head_keys(prefix: str, n_layers: int, n_heads: int) -> tuple[str, ...]:
    return tuple(f"{prefix}/{head_name(layer, head)}" for layer in range(n_layers) for head in range(n_heads))


def flatten(tree, prefix: str = "") -> dict[str, object]:
    """A nested config's dotted keys, ``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values): how
    ``conf.validate`` compares two configs and the sweep report reads a W&B run's config."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, object] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return {key.rstrip("."): value for key, value in flat.items()}
