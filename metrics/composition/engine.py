"""All-pairs composition from per-head cores: cost follows the mathematics, not pairs × ``d_model``.

Per head, one QR of each weight (``W_Q, W_K, W_V, W_O``, ``[d_model, d_head]``) and two
``d_head x d_head`` SVDs give every circuit's singular values and an orthonormal basis of where it
writes (a writer's ``W_OV``) or reads (a reader's ``W_QK``, ``W_QKᵀ`` or ``W_OV``). The V reader's
core is the writer's (both are ``W_OV``) and the Q reader's is the transpose of the K reader's, so
two SVDs serve all three kinds.

Between heads, every measure needs only the cosines ``U_Aᵀ V_B`` of each pair (see
:mod:`metrics.composition.measures`). For all writers of the layers before a reader layer against
all of that layer's readers and kinds, those are the blocks of one GEMM
``[writers·d_head, d_model] @ [d_model, kinds·heads·d_head]``, chunked over writers so the product
stays under ``max_chunk_bytes``. No per-pair ``d_model``-sized tensor is ever formed; memory is the
per-head bases plus one chunk.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits
from metrics.composition.measures import COMPOSITION_KINDS, Measure, PairStats, Spectra

DEFAULT_CHUNK_BYTES = 256 * 2**20


def head_spectra(circuits: HeadCircuits) -> tuple[Spectra, dict[str, Spectra]]:
    """Every head as a writer (``W_OV``: right singular vectors, where it writes) and as a reader of
    each kind (left singular vectors, where it reads): ``basis [..., L·H, d_model, d_head]``,
    ``sq [..., L·H, d_head]``, for circuits ``[..., L, H, d_model, d_head]`` (leading dims, e.g.
    several residual bases, are batched through every factorisation)."""
    qk, ov = circuits.qk.map(_flatten_heads), circuits.ov.map(_flatten_heads)
    # one QR for all four weights and one SVD for both cores: on small models the per-call cost of
    # LAPACK, not the arithmetic, is what a snapshot pays
    q, t = orthonormal_factor(torch.stack([ov.left, ov.right, qk.left, qk.right]))  # W_V, W_Oᵀ, W_Q, W_K
    q_v, q_o, q_q, q_k = q
    p, s, wh = torch.linalg.svd(torch.stack([t[0] @ t[1].mT, t[2] @ t[3].mT]))  # cores of W_OV = W_V W_O, W_QK = W_Q W_Kᵀ
    (p_ov, p_qk), (s_ov, s_qk), (wh_ov, wh_qk) = p, s.square(), wh
    writer = Spectra(q_o @ wh_ov.mT, s_ov)
    readers = {
        "Q": Spectra(q_q @ p_qk, s_qk),  # B = W_QK reads along its left singular vectors
        "K": Spectra(q_k @ wh_qk.mT, s_qk),  # B = W_QKᵀ: W_QK's right singular vectors
        "V": Spectra(q_v @ p_ov, s_ov),  # B = W_OV
    }
    return writer, readers


def orthonormal_factor(factors: Tensor) -> tuple[Tensor, Tensor]:
    """Reduced QR ``factors = Q T`` of a stack ``[..., d, r]``, by CholeskyQR2 (Fukaya et al. 2014):
    ``T₁ = chol(FᵀF)``, ``Q₁ = F T₁⁻¹``, then once more on ``Q₁``. Two Gram GEMMs and two small
    Cholesky factorisations are an order of magnitude faster than Householder QR on a batch of
    heads, and the second pass makes ``Q`` orthonormal to rounding while ``eps·κ(F)² < 1``
    (κ up to ~10⁷ in float64, ~10³ in float32). Where a Cholesky fails (a factor that ill-conditioned
    or rank-deficient) the whole stack falls back to Householder QR. ``T``'s diagonal may be negative
    only in the fallback; nothing here depends on its sign."""
    q, t = factors, None
    eye = torch.eye(factors.shape[-1], dtype=factors.dtype, device=factors.device)
    for _ in range(2):
        lower, info = torch.linalg.cholesky_ex(q.mT @ q)  # (..., r, r)
        if bool((info != 0).any()) or not bool(lower.isfinite().all()):
            return torch.linalg.qr(factors)
        upper = lower.mT
        q = q @ torch.linalg.solve_triangular(upper, eye, upper=True)  # F T⁻¹ as a GEMM: faster than a batched TRSM
        t = upper if t is None else upper @ t
    return q, t


def _flatten_heads(factor: Tensor) -> Tensor:
    return factor.flatten(-4, -3)  # (..., L, H, d, r) -> (..., L H, d, r)


def all_pair_stats(
    writer: Spectra,
    readers: dict[str, Spectra],
    n_layers: int,
    n_heads: int,
    cosine_mass: bool = False,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> PairStats:
    """:class:`PairStats` of every writer → reader pair, for the kinds in ``readers`` (in their order).

    Spectra ``[..., L·H, ...]`` (leading dims batched); fields broadcast to ``[..., kind, L·H
    (writer), L·H (reader), d_head]``, NaN unless the reader's layer is later. ``cosine_mass``:
    also ``Σ cos²θ`` per pair (the subspace measure needs it).
    """
    kinds = list(readers)
    *lead, n, d, r = writer.basis.shape
    H, K = n_heads, len(kinds)
    reader_basis = torch.stack([readers[k].basis for k in kinds], dim=-4)  # (..., K, n, d, r)
    reader_sq = torch.stack([readers[k].sq for k in kinds], dim=-3)  # (..., K, n, r)
    energy = writer.sq.new_full((*lead, K, n, n, r), math.nan)
    mass = writer.sq.new_full((*lead, K, n, n), math.nan) if cosine_mass else None
    batch = math.prod(lead)
    bytes_per_writer = 3 * batch * r * K * H * r * writer.basis.element_size()  # the product, its square, a temporary
    writers_per_chunk = max(1, max_chunk_bytes // bytes_per_writer)
    for l2 in range(1, n_layers):
        heads = slice(l2 * H, (l2 + 1) * H)
        right = reader_basis[..., heads, :, :].movedim(-2, -4).reshape(*lead, d, K * H * r)  # (..., d, K H r)
        weights = reader_sq[..., heads, :]  # (..., K, H, r)
        for w0 in range(0, l2 * H, writers_per_chunk):
            w1 = min(l2 * H, w0 + writers_per_chunk)
            left = writer.basis[..., w0:w1, :, :].mT.reshape(*lead, -1, d)  # (..., w r, d)
            cos2 = (left @ right).square_().view(*lead, w1 - w0, r, K, H, r)  # (..., w, r_a, K, H, r_b)
            energy[..., w0:w1, heads, :] = torch.einsum("...wikhj,...khj->...kwhi", cos2, weights)
            if mass is not None:
                mass[..., w0:w1, heads] = cos2.sum((-4, -1)).movedim(-2, -3)
    return PairStats(energy, writer.sq[..., None, :, None, :], reader_sq[..., None, :, :], mass)


def composition_scores(
    circuits: HeadCircuits,
    measures: Measure | tuple[Measure, ...],
    kinds: tuple[str, ...] = COMPOSITION_KINDS,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, dict[str, Tensor]]:
    """``{measure name: {kind: [..., n_layers, n_heads, n_layers, n_heads]}}`` for every head pair.

    Entry ``[l1, h1, l2, h2]`` scores writer ``L{l1}H{h1}`` into reader ``L{l2}H{h2}``; pairs with
    ``l2 <= l1`` are NaN, never scored. The measures are scored on ``circuits`` as given (leading
    dims batched): a caller whitens the circuits first for a whitened basis
    (:func:`metrics.composition.whitening.whiten`).
    """
    measures = (measures,) if isinstance(measures, Measure) else tuple(measures)
    unknown = set(kinds) - set(COMPOSITION_KINDS)
    if unknown:
        raise ValueError(f"composition kinds must be in {COMPOSITION_KINDS}, got {sorted(unknown)}")
    *lead, L, H, _, _ = circuits.qk.left.shape
    writer, readers = head_spectra(circuits)
    stats = all_pair_stats(
        writer, {k: readers[k] for k in kinds}, L, H,
        cosine_mass=any(m.needs_cosine_mass for m in measures), max_chunk_bytes=max_chunk_bytes,
    )
    scores = {m.name: m.score(stats).reshape(*lead, len(kinds), L, H, L, H) for m in measures}  # all kinds at once
    return {name: {kind: values[..., i, :, :, :, :] for i, kind in enumerate(kinds)} for name, values in scores.items()}


def layer_order_pairs(n_layers: int, n_heads: int) -> tuple[Tensor, Tensor]:
    """Flat head indices ``(writers [P], readers [P])`` of every pair with writer layer < reader layer."""
    layer = torch.arange(n_layers).repeat_interleave(n_heads)  # (n_layers * n_heads,)
    writers, readers = torch.nonzero(layer[:, None] < layer[None, :], as_tuple=True)
    return writers, readers


def composition_flops(n_layers: int, n_heads: int, d_model: int, d_head: int, measures, kinds: int = 3) -> float:
    """fp32 GEMM FLOPs of :func:`composition_scores` for ``measures`` (names or :class:`Measure`):
    the pair products (one GEMM per basis per reader layer) plus, per whitened basis, the whitening
    of every head's four weights. QRs, ``d_head``-sized SVDs and elementwise work are not counted."""
    from metrics.composition.measures import COMPOSITION_MEASURES

    bases = {(COMPOSITION_MEASURES[m] if isinstance(m, str) else m).basis for m in measures}
    layer_pairs = n_layers * (n_layers - 1) / 2  # Σ over reader layers of the layers before it
    pair_products = 2.0 * (n_heads * d_head) * d_model * (kinds * n_heads * d_head) * layer_pairs
    whitening = 2.0 * d_model * d_model * d_head * 4 * n_layers * n_heads
    return len(bases) * pair_products + sum(b != "raw" for b in bases) * whitening
