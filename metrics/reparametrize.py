"""Function-preserving reparametrisations of an attention-only transformer (MEASURES.md axiom 4;
seed 001). Each returns a new model with the same logits and different weights."""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from models.transformer import AttentionOnlyTransformer


def residual_transform(model: AttentionOnlyTransformer, T: Tensor) -> AttentionOnlyTransformer:
    """``x -> x T`` on the residual stream (``T [d_model, d_model]`` invertible): writers ``W -> W T``
    (``W_E, W_pos, W_O``), readers ``W -> T⁻¹ W`` (``W_Q, W_K, W_V, W_U``).

    Function-preserving for ``normalization: none`` with any invertible T; with LayerNorm or
    RMSNorm only for orthogonal T (up to a global scale), as seed 001 notes.
    """
    new = copy.deepcopy(model)
    T = T.to(model.W_E.dtype)
    T_inv = torch.linalg.inv(T)
    with torch.no_grad():
        new.W_E.copy_(model.W_E @ T)
        new.W_pos.copy_(model.W_pos @ T)
        new.W_U.copy_(T_inv @ model.W_U)
        for old_layer, layer in zip(model.layers, new.layers):
            for name in ("W_Q", "W_K", "W_V"):
                getattr(layer, name).copy_(T_inv @ getattr(old_layer, name))
            layer.W_O.copy_(old_layer.W_O @ T)
    return new
