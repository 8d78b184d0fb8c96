"""Eigenvalue scores of end-to-end circuits (Elhage et al. 2021; Olsson et al. 2022), computed in
``d_head`` space: the non-zero eigenvalues of ``X Y`` equal those of ``Y X``.

The score of a matrix is ``Σ Re λ / Σ |λ|`` in ``[-1, 1]``: 1 when every eigenvalue is positive.
"""

from __future__ import annotations

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits, weight
from metrics.composition.measures import layer_order_pairs
from models.transformer import AttentionOnlyTransformer, norm_gain


def eigenvalue_positivity(matrices: Tensor) -> Tensor:
    """``Σ Re λ / Σ |λ|`` of each ``[..., r, r]`` matrix -> ``[...]``."""
    eigenvalues = torch.linalg.eigvals(matrices)
    return eigenvalues.real.sum(-1) / eigenvalues.abs().sum(-1)


def folded_unembedding(model: AttentionOnlyTransformer) -> Tensor:
    """``W_U [d_model, d_vocab]`` with the final norm's gain folded in, float64."""
    gain = norm_gain(model.final_norm)
    W_U = weight(model.W_U)
    return W_U if gain is None else weight(gain)[:, None] * W_U


def copying_scores(model: AttentionOnlyTransformer, circuits: HeadCircuits) -> Tensor:
    """Copying score of every head's full OV circuit ``W_E W_OV W_U [d_vocab, d_vocab]``, from the
    eigenvalues of ``(W_O W_U)(W_E W_V)`` ``[d_head, d_head]`` -> ``[n_layers, n_heads]``."""
    W_E = weight(model.W_E)  # (v, d)
    writes = circuits.ov.right.mT @ folded_unembedding(model)  # (L, H, r, v) = W_O W_U
    reads = W_E @ circuits.ov.left  # (L, H, v, r) = W_E W_V
    return eigenvalue_positivity(writes @ reads)


def matching_scores(model: AttentionOnlyTransformer, circuits: HeadCircuits) -> Tensor:
    """Olsson's QK eigenvalue trace of each pair: ``W_E W_QK² (W_E W_OV¹)ᵀ [d_vocab, d_vocab]``,
    positive when reader h2 attends to keys whose previous token (written there by h1) equals the
    query token. Via ``(K²ᵀ W_O¹ᵀ)(W_V¹ᵀ W_Eᵀ W_E Q²)`` ``[d_head, d_head]``.
    ``[n_layers, n_heads, n_layers, n_heads]``, NaN unless the reader's layer is later."""
    L, H = circuits.n_layers, circuits.n_heads
    writers, readers = layer_order_pairs(L, H)
    W_E = weight(model.W_E)
    ov, qk = circuits.ov.flatten_heads(), circuits.qk.flatten_heads()
    key_side = qk.right[readers].mT @ ov.right[writers]  # (P, r, r) = W_K²ᵀ W_O¹ᵀ
    query_side = (W_E @ ov.left[writers]).mT @ (W_E @ qk.left[readers])  # (P, r, r) = (W_E W_V¹)ᵀ (W_E W_Q²)
    full = torch.full((L * H, L * H), float("nan"), dtype=W_E.dtype)
    full[writers, readers] = eigenvalue_positivity(key_side @ query_side)
    return full.reshape(L, H, L, H)
