"""Composition measures beyond the Frobenius ratio, all from ``d_head x d_head`` cores.

- Singular-value bound (Turner & Strand, in Lieberum's "Composition in transformers", seed 000):
  ``‖A B‖_F / sqrt(Σ_i σ↓_i(A)² σ↓_i(B)²)``, the tight von Neumann bound as denominator.
- Subspace overlap (seed 003, Snell; projection kernel of Yamagiwa et al. 2026): principal angles
  between the writer's write subspace (row space of ``W_O¹``) and the reader's read subspace
  (column space of ``W_Q²``, ``W_K²`` or ``W_V²``): ``Σ cos²θ_i / d_head``.
- Per-component (Merullo et al. 2024, "Talking Heads"): split the writer into its rank-1 SVD
  components, score the reader against each with the Frobenius ratio; the best component's score
  and its share of ``‖A B‖_F²``.

Each takes aligned writers ``[P]`` and readers ``[P]`` (:class:`LowRank`, ``A = writer``, ``B =
reader``, the product ``A B``) and returns ``[P]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from metrics.composition.circuits import LowRank
from metrics.composition.measures import core, product_core


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
