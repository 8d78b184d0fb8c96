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

The Frobenius ratio needs less: ``‖A B‖_F² = ⟨AᵀA, B Bᵀ⟩``, the inner product of two ``d_model x
d_model`` Gram matrices of rank ``d_head``. When every requested measure is a Frobenius ratio (in
whatever basis) and ``d_model < d_head²``, :func:`gram_frobenius` forms each head's Gram once
(``2 d_model² d_head`` FLOPs) and scores every pair as a dot product of their upper triangles
(``d_model²`` per pair, against ``2 d_model d_head²`` for the pair's cosines): at 12 × 12 × 768 × 64
about a third of the FLOPs, and no QR or SVD at all.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits
from metrics.composition.measures import COMPOSITION_KINDS, Measure, PairStats, Spectra, frobenius_score

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
    p, s, wh = torch.linalg.svd(
        torch.stack([t[0] @ t[1].mT, t[2] @ t[3].mT])
    )  # cores of W_OV = W_V W_O, W_QK = W_Q W_Kᵀ
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
    allow_gram: bool = True,
) -> dict[str, dict[str, Tensor]]:
    """``{measure name: {kind: [..., n_layers, n_heads, n_layers, n_heads]}}`` for every head pair.

    Entry ``[l1, h1, l2, h2]`` scores writer ``L{l1}H{h1}`` into reader ``L{l2}H{h2}``; pairs with
    ``l2 <= l1`` are NaN, never scored. The measures are scored on ``circuits`` as given (leading
    dims batched): a caller whitens the circuits first for a whitened basis
    (:func:`metrics.composition.whitening.whiten`). ``allow_gram``: Frobenius-only calls may take
    :func:`gram_frobenius` (its sums lose ``eps·κ`` to rounding when the factors' scales spread by κ:
    a caller with ill-conditioned factors passes False).
    """
    measures = (measures,) if isinstance(measures, Measure) else tuple(measures)
    unknown = set(kinds) - set(COMPOSITION_KINDS)
    if unknown:
        raise ValueError(f"composition kinds must be in {COMPOSITION_KINDS}, got {sorted(unknown)}")
    *lead, L, H, d, r = circuits.qk.left.shape
    if allow_gram and all(m.score is frobenius_score for m in measures) and uses_gram_products(d, r):
        ratio = gram_frobenius(circuits, kinds, max_chunk_bytes).reshape(*lead, len(kinds), L, H, L, H)
        return {m.name: {kind: ratio[..., i, :, :, :, :] for i, kind in enumerate(kinds)} for m in measures}
    writer, readers = head_spectra(circuits)
    stats = all_pair_stats(
        writer,
        {k: readers[k] for k in kinds},
        L,
        H,
        cosine_mass=any(m.needs_cosine_mass for m in measures),
        max_chunk_bytes=max_chunk_bytes,
    )
    scores = {m.name: m.score(stats).reshape(*lead, len(kinds), L, H, L, H) for m in measures}  # all kinds at once
    return {name: {kind: values[..., i, :, :, :, :] for i, kind in enumerate(kinds)} for name, values in scores.items()}


def uses_gram_products(d_model: int, d_head: int) -> bool:
    """Whether a Frobenius-only pass scores pairs through Gram matrices (``d_model²`` FLOPs a pair)
    rather than cosines (``2 d_model d_head²``): when ``d_model < d_head²``, e.g. 64 < 16², 768 < 64²."""
    return d_model < d_head * d_head


# the factors of each reader kind's B = inner @ outer.mT: `inner` is what meets the writer's output
READER_FACTORS = {"Q": ("qk", "left", "right"), "K": ("qk", "right", "left"), "V": ("ov", "left", "right")}


def gram_blocks(d_model: int) -> list[tuple[slice, slice]]:
    """The blocks ``(rows, cols)`` of a symmetric ``d_model x d_model`` matrix on or above the
    diagonal, for ``d_model`` cut in up to 4 pieces of at least ~192 rows: 10 of 16 blocks at
    d_model 768, so a Gram and the inner product of two cost 5/8 of the full matrices."""
    pieces = max(1, min(4, d_model // 192))
    bounds = [round(k * d_model / pieces) for k in range(pieces + 1)]
    cuts = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    return [(cuts[i], cuts[j]) for i in range(pieces) for j in range(i, pieces)]


def gram_frobenius(
    circuits: HeadCircuits, kinds: tuple[str, ...], max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Tensor:
    """The Frobenius ratio ``‖A B‖_F / (‖A‖_F ‖B‖_F)`` (Elhage et al. 2021) of every writer → reader
    pair: ``[..., kind, L·H (writer), L·H (reader)]``, NaN unless the reader's layer is later.

    With ``A = a bᵀ`` (``a = W_V``, ``b = W_Oᵀ``) and ``B = c eᵀ`` (per kind, ``c`` the factor that
    reads the writer's output), ``‖A B‖_F² = ⟨b (aᵀa) bᵀ, c (eᵀe) cᵀ⟩``: each head's symmetric
    ``d_model x d_model`` Gram is formed once, as its blocks on and above the diagonal
    (:func:`gram_blocks`; the reader's off-diagonal blocks counted twice). Readers are taken a group
    of layers at a time, as many as ``max_chunk_bytes`` holds, and each group against every writer
    before it is one accumulated GEMM per block ``[writers, block] @ [block, readers·kinds]``: large
    enough to run at the machine's GEMM rate, at the price of also scoring the pairs inside the
    group that the layer order then masks. The norms are ``tr(aᵀa · bᵀb)``, from ``d_head``-sized
    Grams. Memory: every writer's Grams (or one chunk of writers at a time, re-formed per group,
    when they exceed ``max_chunk_bytes``) and one group of readers'.
    """
    *lead, L, H, d, r = circuits.qk.left.shape
    n, K = L * H, len(kinds)
    blocks = gram_blocks(d)
    block_sizes = [(rows.stop - rows.start) * (cols.stop - cols.start) for rows, cols in blocks]
    factors = {
        (c, side): getattr(getattr(circuits, c), side).reshape(-1, n, d, r)
        for c in ("qk", "ov")
        for side in ("left", "right")
    }
    small_grams = {key: f.mT @ f for key, f in factors.items()}  # (batch, n, r, r): W_Qᵀ W_Q, ... once each

    def block_grams(
        inner: str, outer: str, heads: slice, into: list[Tensor] | None = None, off_diagonal: float = 1.0
    ) -> list[Tensor]:
        """``inner (outerᵀ outer) innerᵀ`` of the heads ``heads`` (factors named by ``(circuit, side)``),
        block by block, each ``[batch, h, block]``, into the buffers ``into`` when given."""
        inner_factor = factors[inner][:, heads]
        left = inner_factor @ small_grams[outer][:, heads]  # (batch, h, d, r)
        shape = inner_factor.shape[:2]
        out = into or [left.new_empty(*shape, size) for size in block_sizes]
        for (rows, cols), buffer in zip(blocks, out):
            scaled = left[..., rows, :] if rows == cols or off_diagonal == 1.0 else off_diagonal * left[..., rows, :]
            torch.matmul(
                scaled,
                inner_factor[..., cols, :].mT,
                out=buffer.view(*shape, rows.stop - rows.start, cols.stop - cols.start),
            )
        return out

    writer = (("ov", "right"), ("ov", "left"))  # A = W_V W_O: AᵀA = W_Oᵀ (W_Vᵀ W_V) W_O
    readers_of = [((c, inner), (c, outer)) for c, inner, outer in map(READER_FACTORS.get, kinds)]
    norm = lambda x, y: (small_grams[x] * small_grams[y]).sum((-1, -2))  # tr(xᵀx yᵀy) = ‖x yᵀ‖_F²
    writer_norm = norm(*writer)  # (batch, n)
    reader_norm = torch.stack([norm(*pair) for pair in readers_of], dim=1)  # (batch, K, n)
    batch, element = writer_norm.shape[0], factors[writer[0]].element_size()
    bytes_per_head = sum(block_sizes) * batch * element
    writers_fit = (n - H) * bytes_per_head <= max_chunk_bytes
    all_writers = block_grams(*writer, slice(0, n - H)) if writers_fit else None
    writers_per_chunk = n if writers_fit else max(1, max_chunk_bytes // (2 * bytes_per_head))
    # two groups at least: a group is scored against every writer before its last layer, so halving
    # it saves a quarter of the products (at 12 layers) while its GEMMs stay large
    layers_per_group = max(1, min(math.ceil((L - 1) / 2), max_chunk_bytes // (K * H * bytes_per_head)))
    readers = [
        writer_norm.new_empty(batch, K * layers_per_group * H, size) for size in block_sizes
    ]  # (batch, (kind, layer, head), block)
    energy = writer_norm.new_full((batch, K, n, n), math.nan)
    for first in range(1, L, layers_per_group):
        layers = range(first, min(L, first + layers_per_group))
        heads, g = slice(first * H, (layers[-1] + 1) * H), len(layers) * H  # the group's heads, contiguous
        group = [buffer[:, : K * g] for buffer in readers]
        for k, pair in enumerate(readers_of):
            block_grams(*pair, heads, [buffer[:, k * g : (k + 1) * g] for buffer in group], off_diagonal=2.0)
        for w0 in range(0, layers[-1] * H, writers_per_chunk):
            w1 = min(layers[-1] * H, w0 + writers_per_chunk)
            writers = [w[:, w0:w1] for w in all_writers] if writers_fit else block_grams(*writer, slice(w0, w1))
            products = sum(w @ q.mT for w, q in zip(writers, group)).unflatten(
                -1, (K, len(layers), H)
            )  # (batch, w, K, g, H)
            for i, l2 in enumerate(layers):
                if w0 < l2 * H:
                    end = min(w1, l2 * H)
                    energy[:, :, w0:end, l2 * H : (l2 + 1) * H] = products[:, : end - w0, :, i].movedim(
                        -2, -3
                    )  # (batch, K, w, H)
    ratio = (energy.clamp_min(0) / (writer_norm[:, None, :, None] * reader_norm[:, :, None, :])).sqrt()
    return ratio.reshape(*lead, K, n, n)


def composition_flops(
    n_layers: int,
    n_heads: int,
    d_model: int,
    d_head: int,
    measures,
    kinds: int = 3,
    well_conditioned: bool = True,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    itemsize: int = 4,
) -> float:
    """fp32 GEMM FLOPs of :func:`metrics.composition.scores.composition_of` for ``measures`` (names or
    :class:`Measure`), following its choices: the residual bases are scored together on small models
    and one at a time on large ones (``basis_groups``), and a group whose measures are all Frobenius
    ratios takes the Gram path where it is cheaper (its whitened bases only when
    ``well_conditioned``). Per basis: the pair products (cosines: one GEMM per reader layer; Grams: the
    writers' and readers' Gram blocks, then their products) plus, for a whitened basis, the whitening
    of every head's four weights. QRs, ``d_head``-sized factorisations and elementwise work are not counted."""
    from metrics.composition.measures import WEIGHT_MEASURES

    by_basis: dict[str, list[Measure]] = {}
    for m in measures:
        if isinstance(m, str) and m not in WEIGHT_MEASURES:
            continue  # the data-aware share: no weight products
        m = WEIGHT_MEASURES[m] if isinstance(m, str) else m
        by_basis.setdefault(m.basis, []).append(m)
    n = n_layers * n_heads
    layer_pairs = n_layers * (n_layers - 1) / 2  # Σ over reader layers of the layers before it
    cosines = 2.0 * (n_heads * d_head) * d_model * (kinds * n_heads * d_head) * layer_pairs
    gram_entries = sum((rows.stop - rows.start) * (cols.stop - cols.start) for rows, cols in gram_blocks(d_model))
    grams = (
        2.0 * gram_entries * d_head * (1 + kinds) * (n - n_heads)
        + 2.0 * gram_entries * kinds * n_heads * n_heads * layer_pairs
    )
    whitening = 2.0 * d_model * d_model * d_head * 4 * n
    per_basis_bytes = 12 * n * d_model * d_head * itemsize  # as metrics.composition.scores.basis_groups counts
    stacked = len(by_basis) * per_basis_bytes <= max_chunk_bytes // 4
    groups = [list(by_basis)] if stacked else [[b] for b in by_basis]
    total = 0.0
    for group in groups:
        gram_path = (
            all(m.score is frobenius_score for b in group for m in by_basis[b])
            and uses_gram_products(d_model, d_head)
            and (well_conditioned or group == ["raw"])
        )
        total += len(group) * (grams if gram_path else cosines) + sum(b != "raw" for b in group) * whitening
    return total
