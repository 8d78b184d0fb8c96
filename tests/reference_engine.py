"""The composition engine as it stood before the all-pairs rewrite (commit 6878a2e): per-pair
``d_model``-sized stacks, scored measure by measure. Kept verbatim as a reference that the new
engine (:mod:`metrics.composition.engine`) must equal on random weights; too slow and too big for
real models (it gathers ``[pairs, d_model, d_head]`` stacks). One change since: under LayerNorm
:func:`head_circuits` folds the centring into the readers as well as the gain, and centres the
writers' ``W_O``, the convention of ``metrics/composition/circuits.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.transformer import AttentionOnlyTransformer, norm_gain


def triangular_factor(factor: Tensor) -> Tensor:
    """``T`` of the reduced QR ``factor = Q T``: ``[..., d_model, r] -> [..., r, r]``.

    ``Q`` has orthonormal columns, so ``factor`` and ``T`` have the same Gram matrix and the same
    singular values: every unitarily invariant quantity can be computed from ``T``.
    """
    return torch.linalg.qr(factor, mode="r").R


@dataclass(frozen=True)
class LowRank:
    """A stack of ``d_model x d_model`` matrices ``left @ right.mT``; ``left, right [..., d_model, rank]``.

    ``left_t``, ``right_t`` (``[..., rank, rank]``) are the factors' QR triangles, computed once
    per head by :meth:`with_triangles` and carried along by indexing, so scoring many pairs does
    not factorise the same head again.
    """

    left: Tensor
    right: Tensor
    left_t: Tensor | None = None
    right_t: Tensor | None = None

    def dense(self) -> Tensor:
        """The full matrices ``[..., d_model, d_model]``: for tests and references only."""
        return self.left @ self.right.mT

    @property
    def T(self) -> LowRank:
        return LowRank(self.right, self.left, self.right_t, self.left_t)

    def with_triangles(self) -> LowRank:
        return LowRank(self.left, self.right, self.left_triangle(), self.right_triangle())

    def left_triangle(self) -> Tensor:
        return triangular_factor(self.left) if self.left_t is None else self.left_t

    def right_triangle(self) -> Tensor:
        return triangular_factor(self.right) if self.right_t is None else self.right_t

    def map(self, fn) -> LowRank:
        """Apply ``fn`` to every tensor field (e.g. flatten or index the head dimensions)."""
        return LowRank(*(None if t is None else fn(t) for t in (self.left, self.right, self.left_t, self.right_t)))

    def flatten_heads(self) -> LowRank:
        """``[n_layers, n_heads, ...] -> [n_layers * n_heads, ...]``."""
        return self.map(lambda t: t.flatten(0, 1))

    def index(self, idx: Tensor) -> LowRank:
        return self.map(lambda t: t[idx])


@dataclass(frozen=True)
class HeadCircuits:
    """Every head's circuits, ``[n_layers, n_heads, d_model, d_head]`` factors each.

    ``qk``: ``W_QK = W_Q W_Kᵀ`` (logit of dst i, src j is ``x_i W_QK x_jᵀ / sqrt(d_head)``).
    ``ov``: ``W_OV = W_V W_O`` (a head writes ``x_j W_OV``).
    Normalization gains, and LayerNorm's centring, are folded into the reading weights ``W_Q, W_K, W_V``.
    """

    qk: LowRank
    ov: LowRank

    @property
    def n_layers(self) -> int:
        return self.qk.left.shape[0]

    @property
    def n_heads(self) -> int:
        return self.qk.left.shape[1]


def weight(tensor: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """A parameter detached and copied to the CPU in ``dtype``: weight-based metrics are tiny, and
    computing them on the CPU in float64 works for every accelerator (MPS has no float64)."""
    return tensor.detach().to("cpu", dtype)


def head_circuits(model: AttentionOnlyTransformer, dtype: torch.dtype = torch.float64) -> HeadCircuits:
    """The model's QK and OV circuits, detached, on the CPU, in ``dtype`` (float64 for exact scores)."""
    W_Q, W_K, W_V, W_O = [], [], [], []
    with torch.no_grad():
        for layer in model.layers:
            gain = norm_gain(layer.norm)
            fold = (lambda w: w) if gain is None else (lambda w, g=gain: g[None, :, None] * w)
            if isinstance(layer.norm, torch.nn.LayerNorm):  # centring: subtract the mean over d_model
                fold = lambda w, f=fold: f(w) - f(w).mean(dim=1, keepdim=True)  # (head, d_model, d_head)
            W_Q.append(fold(layer.W_Q))
            W_K.append(fold(layer.W_K))
            W_V.append(fold(layer.W_V))
            centred = isinstance(layer.norm, torch.nn.LayerNorm)
            W_O.append(
                layer.W_O - layer.W_O.mean(dim=-1, keepdim=True) if centred else layer.W_O
            )  # (head, d_head, d_model)
        stack = lambda ws: weight(torch.stack(ws), dtype)  # (n_layers, n_heads, ...)
        W_Q, W_K, W_V, W_O = stack(W_Q), stack(W_K), stack(W_V), stack(W_O)
    return HeadCircuits(qk=LowRank(W_Q, W_K).with_triangles(), ov=LowRank(W_V, W_O.mT).with_triangles())


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
    reader = LowRank(
        *(
            None if ts[0] is None else torch.cat(ts)
            for ts in zip(*((r.left, r.right, r.left_t, r.right_t) for r in stacked))
        )
    )
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
    values = measure(
        *(pair_stacks(circuits, kinds) if stacks is None else stacks)
    )  # (len(kinds) * P,): one call scores every kind
    scores = {}
    for i, kind in enumerate(kinds):
        full = torch.full((L * H, L * H), float("nan"), dtype=values.dtype, device=values.device)
        full[writers, readers] = values[i * P : (i + 1) * P]
        scores[kind] = full.reshape(L, H, L, H)
    return scores


def padded_singular_values(matrix: LowRank, length: int) -> Tensor:
    """``σ↓(matrix)`` zero-padded to ``length``: ``[P, length]``."""
    values = torch.linalg.svdvals(core(matrix))  # (P, r), descending
    return torch.nn.functional.pad(values, (0, length - values.shape[-1]))


def singular_value_bound_ratio(writer: LowRank, reader: LowRank) -> Tensor:
    """``‖A B‖_F / sqrt(Σ σ↓_i(A)² σ↓_i(B)²)``: 1 exactly when A's top write directions are B's top
    read directions, in the same order."""
    length = max(writer.left.shape[-1], reader.left.shape[-1])
    bound = (padded_singular_values(writer, length) * padded_singular_values(reader, length)).square().sum(-1).sqrt()
    return torch.linalg.matrix_norm(product_core(writer, reader)) / bound


def orthonormal_basis(factor: Tensor) -> Tensor:
    """An orthonormal basis ``[..., d_model, r]`` of the column space of ``factor [..., d_model, r]``."""
    return torch.linalg.qr(factor).Q


def subspace_overlap(writer: LowRank, reader: LowRank) -> Tensor:
    """``Σ cos²θ_i / r`` for the principal angles between span(``writer.right``), where A writes,
    and span(``reader.left``), where B reads; ``r`` = the smaller dimension. In ``[0, 1]``."""
    writes, reads = orthonormal_basis(writer.right), orthonormal_basis(reader.left)  # (P, d, r)
    cosines = writes.mT @ reads  # (P, r, r): its singular values are cos θ_i
    return torch.linalg.matrix_norm(cosines).square() / min(writes.shape[-1], reads.shape[-1])


VANISHING = 1e-24  # a squared Frobenius ratio below this: A B = 0 up to rounding


def per_component_scores(writer: LowRank, reader: LowRank) -> tuple[Tensor, Tensor]:
    """For each rank-1 SVD component ``A_i = σ_i u_i v_iᵀ`` of A: ``C(A_i, B) = ‖v_iᵀ B‖ / ‖B‖``
    and its share ``‖A_i B‖² / ‖A B‖²`` (the components' products are orthogonal, so the shares
    sum to 1; NaN when ``A B`` vanishes). Both ``[P, r]``."""
    t_left = writer.left_triangle()  # A = Q_l T_l T_rᵀ Q_rᵀ
    _, sigma, v_h = torch.linalg.svd(t_left @ writer.right_triangle().mT)  # core = U S Vᵀ
    right_vectors = orthonormal_basis(writer.right) @ v_h.mT  # (P, d, r): A's right singular vectors
    reads = right_vectors.mT @ reader.left @ reader.right_triangle().mT  # (P, r, r): row i is v_iᵀ B, up to rotation
    per_row = torch.linalg.vector_norm(reads, dim=-1)  # ‖v_iᵀ B‖
    reader_norm = torch.linalg.matrix_norm(core(reader))[..., None]
    energy = (sigma * per_row).square()  # ‖A_i B‖²
    total = energy.sum(-1, keepdim=True)
    vanishing = total <= (VANISHING * sigma.square().sum(-1, keepdim=True) * reader_norm.square())  # C(A, B)² ≈ 0
    shares = torch.where(vanishing, torch.nan, energy / total)  # no product: no share to split
    return per_row / reader_norm, shares


def best_component_ratio(writer: LowRank, reader: LowRank) -> Tensor:
    """The best rank-1 component's Frobenius ratio with the reader."""
    scores, _ = per_component_scores(writer, reader)
    return scores.max(-1).values


def best_component_share(writer: LowRank, reader: LowRank) -> Tensor:
    """The best component's share of ``‖A B‖_F²``: near 1 when one direction carries the composition."""
    scores, shares = per_component_scores(writer, reader)
    return shares.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


def whiten(circuits: HeadCircuits, half: Tensor, inverse_half: Tensor) -> HeadCircuits:
    """The old whitening: readers ``Σ^(1/2) W``, writers ``W_O Σ^(-1/2)``, triangles recomputed."""
    read = lambda w: half @ w
    qk = LowRank(read(circuits.qk.left), read(circuits.qk.right)).with_triangles()
    ov = LowRank(read(circuits.ov.left), inverse_half @ circuits.ov.right).with_triangles()
    return HeadCircuits(qk=qk, ov=ov)


OLD_MEASURES = {
    "frobenius": frobenius_ratio,
    "sv_bound": singular_value_bound_ratio,
    "subspace": subspace_overlap,
    "component": best_component_ratio,
    "component_share": best_component_share,
}
