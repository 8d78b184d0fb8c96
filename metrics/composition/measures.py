"""Q-, K- and V-composition between heads of different layers, batched over all pairs.

Writer head h1 (layer l1) composes into reader head h2 (layer l2 > l1) through the products
(MEASURES.md, row-vector convention):

- Q: ``W_OV¹ · W_QK²``     (h1 writes what h2's queries read)
- K: ``W_OV¹ · W_QK²ᵀ``    (h1 writes what h2's keys read)
- V: ``W_OV¹ · W_OV²``     (h1 writes what h2's values read)

Every product has rank <= d_head, so each score is computed from ``d_head x d_head`` cores:
with ``A = La Raᵀ`` and ``B = Lb Rbᵀ``, ``A B = La (Raᵀ Lb) Rbᵀ``, and with the QR factorisations
``La = Qa Ta``, ``Rb = Qb Tb`` (orthonormal ``Q``), ``‖A B‖ = ‖Ta (Raᵀ Lb) Tbᵀ‖`` in any unitarily
invariant norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits, LowRank

COMPOSITION_KINDS = ("Q", "K", "V")

PairMeasure = Callable[[LowRank, LowRank], Tensor]
"""A composition measure: aligned writers ``[P]`` and readers ``[P]`` -> scores ``[P]``."""


def core(matrix: LowRank) -> Tensor:
    """A ``[..., r, r]`` matrix with the singular values of ``matrix.dense()``."""
    return matrix.left_triangle() @ matrix.right_triangle().mT


def product_core(writer: LowRank, reader: LowRank) -> Tensor:
    """A ``[P, r, r]`` matrix with the singular values of ``writer.dense() @ reader.dense()``."""
    middle = writer.right.mT @ reader.left  # (P, r, r)
    return writer.left_triangle() @ middle @ reader.right_triangle().mT


def frobenius_ratio(writer: LowRank, reader: LowRank) -> Tensor:
    """``‖A B‖_F / (‖A‖_F ‖B‖_F)`` for aligned stacks ``A = writer[p]``, ``B = reader[p]`` -> ``[P]``.

    Elhage et al. 2021. At most 1; about ``d_model^-1/2`` for random matrices; never 1 for rank > 1.
    """
    norm = lambda m: torch.linalg.matrix_norm(m)  # Frobenius, over the last two dims
    return norm(product_core(writer, reader)) / (norm(core(writer)) * norm(core(reader)))


def reader_circuit(circuits: HeadCircuits, kind: str) -> LowRank:
    """What a reader head reads with, for composition ``kind`` in Q, K, V."""
    if kind == "Q":
        return circuits.qk
    if kind == "K":
        return circuits.qk.T
    if kind == "V":
        return circuits.ov
    raise ValueError(f"composition kind must be one of {COMPOSITION_KINDS}, got {kind!r}")


def layer_order_pairs(n_layers: int, n_heads: int) -> tuple[Tensor, Tensor]:
    """Flat head indices ``(writers [P], readers [P])`` of every pair with writer layer < reader layer."""
    layer = torch.arange(n_layers).repeat_interleave(n_heads)  # (n_layers * n_heads,)
    writers, readers = torch.nonzero(layer[:, None] < layer[None, :], as_tuple=True)
    return writers, readers


def pair_stacks(circuits: HeadCircuits, kinds: tuple[str, ...] = COMPOSITION_KINDS) -> tuple[LowRank, LowRank]:
    """Aligned ``(writers, readers)`` stacks ``[len(kinds) * P]`` for every kind and every pair with
    the reader in a later layer: kind ``i``'s pairs are rows ``i * P .. (i + 1) * P``."""
    writers, readers = layer_order_pairs(circuits.n_layers, circuits.n_heads)
    ov = circuits.ov.flatten_heads().index(writers.repeat(len(kinds)))
    stacked = [reader_circuit(circuits, kind).flatten_heads().index(readers) for kind in kinds]
    reader = LowRank(*(None if ts[0] is None else torch.cat(ts) for ts in zip(*(
        (r.left, r.right, r.left_t, r.right_t) for r in stacked))))
    return ov, reader


def composition_scores(
    circuits: HeadCircuits,
    measure: PairMeasure = frobenius_ratio,
    kinds: tuple[str, ...] = COMPOSITION_KINDS,
    stacks: tuple[LowRank, LowRank] | None = None,
) -> dict[str, Tensor]:
    """``measure`` for every kind and every head pair, ``{kind: [n_layers, n_heads, n_layers, n_heads]}``.

    Entry ``[l1, h1, l2, h2]`` scores writer ``L{l1}H{h1}`` into reader ``L{l2}H{h2}``; pairs with
    ``l2 <= l1`` are masked as NaN, never scored. ``stacks``: ``pair_stacks(circuits, kinds)``, if
    the caller scores several measures on the same circuits.
    """
    L, H = circuits.n_layers, circuits.n_heads
    writers, readers = layer_order_pairs(L, H)
    P = len(writers)
    values = measure(*(pair_stacks(circuits, kinds) if stacks is None else stacks))  # (len(kinds) * P,): one call scores every kind
    scores = {}
    for i, kind in enumerate(kinds):
        full = torch.full((L * H, L * H), float("nan"), dtype=values.dtype, device=values.device)
        full[writers, readers] = values[i * P : (i + 1) * P]
        scores[kind] = full.reshape(L, H, L, H)
    return scores
