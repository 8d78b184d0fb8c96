"""Stable, ``/``-namespaced metric keys: a snapshot's outputs (:mod:`metrics.tracked.base`) flattened
into the W&B and CSV keys, by the kind of each output.

A snapshot holds tensors over every (writer, reader) head pair: ``[L, H, L, H]``, NaN where the
reader's layer is not later, so ``P = H² L (L - 1) / 2`` scored pairs. One key per pair is what a
person wants on a small model and unusable on a big one (with the default measures, the
:func:`pair_key_count` of 4 × 8 is 20,736 keys a snapshot, of 12 × 12 513,216), so the pair
outputs are flattened in one of two modes, chosen once per run from how many keys a pair would get
(``per_pair``: the tracked quantities' ``pair_keys`` summed, times ``P``, at most ``max_pair_keys``).

Pair names are ``L0H1->L1H3`` (writer -> reader). Flat head indices are ``layer * n_heads + head``.

``Scalar(name)``
    one key, ``name``
``PerHead(name)``, ``[L, H]``
    ``{name}/L1H3`` for every head while ``L * H <= max_head_keys``, and ``{name}/top`` (the best
    head's score); beyond it ``{name}/top_head`` (the best head as a flat index) instead of per head
``PerPair(name, circuit, top)``, ``[L, H, L, H]``
    per-pair mode: ``{name}/L0H1->L1H3`` for every scored pair; summary mode: ``{name}/{max,mean}``
    over the scored pairs and, with ``top``, the ``top_pairs`` best ``{top}/{i}`` (i = 1 is the
    highest) with ``{top}/{i}/writer`` and ``/reader`` as flat head indices; in both, with ``circuit``,
    the circuit pair's value ``circuit/{circuit}``

Masked (NaN) pairs and heads are never emitted. Which names a snapshot has, and so every key of a
run, is the tracked quantities' (docs/configuration.md, "Logged keys", lists them;
``python -m reports.tracker_keys`` counts them for any shape).
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only for annotations: the keys import nothing heavier than numpy
    from metrics.tracked.base import Output


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def scored_pair_count(n_layers: int, n_heads: int) -> int:
    """Pairs with the reader in a later layer: ``H² L (L - 1) / 2``."""
    return n_heads * n_heads * n_layers * (n_layers - 1) // 2


def pair_key_count(n_layers: int, n_heads: int, keys_per_pair: int) -> int:
    """Keys one snapshot spends on pairs in per-pair mode."""
    return scored_pair_count(n_layers, n_heads) * keys_per_pair


def snapshot_metrics(
    outputs: list[Output], circuit, per_pair: bool, top_pairs: int, max_head_keys: int
) -> dict[str, float]:
    """Every key of a snapshot's ``outputs`` (see the module docstring): pair outputs one key per pair
    (``per_pair``) or as their summaries and ``top_pairs`` best pairs; per-head keys while the model
    has at most ``max_head_keys`` heads; ``circuit``: the snapshot's circuit pair (None: no ``circuit/`` keys of pairs)."""
    from metrics.tracked.base import PerHead, PerPair, Scalar, as_numpy

    families = PairFamilies(per_pair, top_pairs, circuit)
    metrics: dict[str, float] = {}
    for output in outputs:
        if isinstance(output, Scalar):
            metrics[output.name] = float(output.value)
        elif isinstance(output, PerHead):
            metrics.update(head_metrics(output.name, as_numpy(output.values), max_head_keys))
        elif isinstance(output, PerPair):
            metrics.update(families.metrics(output.name, as_numpy(output.values), output.circuit, output.top))
    return metrics


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
