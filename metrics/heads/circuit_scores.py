"""Eigenvalue scores of end-to-end circuits (Elhage et al. 2021; Olsson et al. 2022), computed in
``d_head`` space: the non-zero eigenvalues of ``X Y`` equal those of ``Y X``.

The score of a matrix is ``Σ Re λ / Σ |λ|`` in ``[-1, 1]``: 1 when every eigenvalue is positive.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits, centre_writing, fold_norm
from models.transformer import AttentionOnlyTransformer

MATCHING = "match"
"""The QK matching score's name where it is judged against the ablation beside the composition measures."""


def eigenvalue_positivity(matrices: Tensor) -> Tensor:
    """``Σ Re λ / Σ |λ|`` of each ``[..., r, r]`` matrix -> ``[...]``, on the CPU: the matrices are
    ``d_head``-sized, and a general eigendecomposition is not implemented on MPS and runs serially,
    with a host sync, on CUDA."""
    eigenvalues = torch.linalg.eigvals(matrices.to("cpu"))
    return eigenvalues.real.sum(-1) / eigenvalues.abs().sum(-1)


def folded_unembedding(model: AttentionOnlyTransformer, dtype: torch.dtype | None = None) -> Tensor:
    """``W_U [d_model, d_vocab]`` with the final norm folded in as the heads' reading weights are
    (:func:`~metrics.composition.circuits.fold_norm`: the gain, and LayerNorm's centring), in
    ``dtype`` (default the model's)."""
    return fold_norm(model.final_norm, model.W_U, dtype or model.W_U.dtype)


def copying_scores(model: AttentionOnlyTransformer, circuits: HeadCircuits) -> Tensor:
    """Copying score of every head's full OV circuit ``W_E W_OV W_U [d_vocab, d_vocab]``, from the
    eigenvalues of ``(W_O W_U)(W_E W_V)`` ``[d_head, d_head]`` -> ``[n_layers, n_heads]``. Every
    writer (``W_E``, ``W_O``) meets a folded reader (``W_V``, ``W_U``), so under LayerNorm the
    centring of ``W_E`` (:func:`~metrics.composition.circuits.centre_writing`) changes no value;
    it spares the products the cancellation of a large component along ``1``."""
    dtype = circuits.ov.left.dtype
    W_E = centre_writing(model.final_norm, model.W_E, dtype)  # (v, d)
    writes = circuits.ov.right.mT @ folded_unembedding(model, dtype)  # (L, H, r, v) = W_O W_U
    reads = W_E @ circuits.ov.left  # (L, H, v, r) = W_E W_V
    return eigenvalue_positivity(writes @ reads)


def matching_scores(model: AttentionOnlyTransformer, circuits: HeadCircuits) -> Tensor:
    """Olsson's QK eigenvalue trace of each pair: ``W_E W_QK² (W_E W_OV¹)ᵀ [d_vocab, d_vocab]``,
    positive when reader h2 attends to keys whose previous token (written there by h1) equals the
    query token. Its non-zero eigenvalues are those of ``(W_K²ᵀ W_O¹ᵀ)(W_V¹ᵀ W_Eᵀ W_E W_Q²)``
    ``[d_head, d_head]``; both factors of every pair of a reader layer come from one GEMM each.
    ``[n_layers, n_heads, n_layers, n_heads]``, NaN unless the reader's layer is later. As for
    :func:`copying_scores`, every writer meets a folded reader: centring ``W_E`` changes no value."""
    L, H = circuits.n_layers, circuits.n_heads
    ov, qk = circuits.ov.flatten_heads(), circuits.qk.flatten_heads()  # (L H, d, r) factors
    dtype = ov.left.dtype
    W_E = centre_writing(model.final_norm, model.W_E, dtype)
    token_gram = W_E.T @ W_E  # (d, d): W_Eᵀ W_E
    n, d, r = ov.left.shape
    full = torch.full((n, n), math.nan, dtype=dtype, device="cpu")  # filled from eigenvalues, on the CPU
    for l2 in range(1, L):
        readers = slice(l2 * H, (l2 + 1) * H)
        writers = slice(0, l2 * H)
        w = l2 * H
        # (w r, H r) blocks: [a, :, b, :] = W_O^a W_K^b, then W_V^aᵀ G W_Q^b
        key_side = (ov.right[writers].mT.reshape(-1, d) @ qk.right[readers].permute(1, 0, 2).reshape(d, -1)).view(
            w, r, H, r
        )
        query_side = (
            ov.left[writers].mT.reshape(-1, d) @ (token_gram @ qk.left[readers]).permute(1, 0, 2).reshape(d, -1)
        ).view(w, r, H, r)
        key_side, query_side = key_side.permute(0, 2, 1, 3), query_side.permute(0, 2, 1, 3)  # (w, H, r, r)
        full[writers, readers] = eigenvalue_positivity(key_side.mT @ query_side)
    return full.reshape(L, H, L, H)
