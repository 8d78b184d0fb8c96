"""Function-preserving reparametrisations of an attention-only transformer (docs/measures.md axiom 4;
Snell 2024). Each returns a new model with the same logits and different weights."""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from models.transformer import AttentionOnlyTransformer


def residual_transform(model: AttentionOnlyTransformer, T: Tensor) -> AttentionOnlyTransformer:
    """``x -> x T`` on the residual stream (``T [d_model, d_model]`` invertible): writers ``W -> W T``
    (``W_E, W_pos, W_O``), readers ``W -> T⁻¹ W`` (``W_Q, W_K, W_V, W_U``).

    Function-preserving for ``normalization: none`` with any invertible T. With a norm, only where
    the norm commutes with T: RMSNorm with unit gains for orthogonal T (up to a global scale, seed
    001); LayerNorm additionally needs T to fix the all-ones direction it centres along
    (:func:`rotation_fixing_ones`). With non-unit gains a rotation changes the logits (measured: by
    up to 2.6 under LayerNorm).
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


def _per_head_transform(
    model: AttentionOnlyTransformer, A: Tensor, first: str, second: str, second_map
) -> AttentionOnlyTransformer:
    """``first -> first A``, ``second -> second_map(A, second)`` for every head; ``A [n_layers, n_heads, d_head, d_head]``."""
    new = copy.deepcopy(model)
    A = A.to(model.W_E.dtype)
    with torch.no_grad():
        for l, (old_layer, layer) in enumerate(zip(model.layers, new.layers)):
            getattr(layer, first).copy_(getattr(old_layer, first) @ A[l])
            getattr(layer, second).copy_(second_map(A[l], getattr(old_layer, second)))
    return new


def value_output_transform(model: AttentionOnlyTransformer, A: Tensor) -> AttentionOnlyTransformer:
    """Head-internal GL(d_head) of the OV circuit: ``W_V -> W_V A``, ``W_O -> A⁻¹ W_O`` per head
    (``A [n_layers, n_heads, d_head, d_head]`` invertible). ``W_OV = W_V W_O`` is unchanged, and so
    is the model's function, with or without normalization."""
    return _per_head_transform(model, A, "W_V", "W_O", lambda a, w: torch.linalg.solve(a, w))


def query_key_transform(model: AttentionOnlyTransformer, A: Tensor) -> AttentionOnlyTransformer:
    """Head-internal GL(d_head) of the QK circuit: ``W_Q -> W_Q A``, ``W_K -> W_K A⁻ᵀ`` per head.
    ``W_QK = W_Q W_Kᵀ`` is unchanged, and so is the model's function."""
    return _per_head_transform(model, A, "W_Q", "W_K", lambda a, w: w @ torch.linalg.inv(a).mT)


def embedding_shift(model: AttentionOnlyTransformer, v: Tensor) -> AttentionOnlyTransformer:
    """``W_E -> W_E + v``, ``W_pos -> W_pos - v`` (``v [d_model]``, every row): the residual stream
    ``W_E[t] + W_pos[p]`` is unchanged, so is the model's function, under any normalization. What moves
    is how the stream splits between tokens and positions: a score built on ``W_E`` alone (token
    space) sees it, one built on the stream's covariance does not."""
    new = copy.deepcopy(model)
    v = v.to(model.W_E.dtype)
    with torch.no_grad():
        new.W_E.copy_(model.W_E + v)
        new.W_pos.copy_(model.W_pos - v)
    return new


def rotation_fixing_ones(d_model: int, generator: torch.Generator, dtype: torch.dtype = torch.float64) -> Tensor:
    """A random rotation ``T [d_model, d_model]`` with ``1 T = 1``: orthogonal, so it commutes with
    LayerNorm's centring ``C``, ``LN(x T) = LN(x) T`` with unit gains. ``B diag(1, R) Bᵀ`` for ``B``
    an orthonormal basis whose first vector is ``1/sqrt(d_model)`` and ``R`` a random rotation of the rest."""
    gaussian = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype)
    B = torch.linalg.qr(torch.cat([torch.ones(d_model, 1, dtype=dtype), gaussian(d_model, d_model - 1)], 1)).Q
    R = torch.linalg.qr(gaussian(d_model - 1, d_model - 1)).Q
    return B @ torch.block_diag(torch.ones(1, 1, dtype=dtype), R) @ B.T


def ones_shift(
    model: AttentionOnlyTransformer,
    W_O: Tensor | None = None,
    W_E: Tensor | None = None,
    W_pos: Tensor | None = None,
) -> AttentionOnlyTransformer:
    """Each row of a writer plus a constant times ``1``: ``W_O[l][h, e, :] += W_O[l, h, e]``
    (``W_O [n_layers, n_heads, d_head]``), ``W_E[t, :] += W_E[t]`` (``[d_vocab]``), ``W_pos[p, :] +=
    W_pos[p]`` (``[n_ctx]``); a writer not given is left alone.

    Function-preserving under LayerNorm: every write moves along ``1`` alone, and every reader of the
    stream reads it through a LayerNorm, ``LN(x + a 1) = LN(x)`` (``W_pos`` only with standard
    positions: shortformer adds it after the norm). Under RMSNorm or no normalization it changes the
    function: there ``W`` and ``W + c 1ᵀ`` are different models. So the composition measures centre
    the writers under LayerNorm alone (:func:`~metrics.composition.circuits.centre_writing`).
    """
    new = copy.deepcopy(model)
    dtype = model.W_E.dtype
    with torch.no_grad():
        if W_O is not None:
            for l, layer in enumerate(new.layers):
                layer.W_O.add_(W_O[l].to(dtype)[..., None])
        if W_E is not None:
            new.W_E.add_(W_E.to(dtype)[:, None])
        if W_pos is not None:
            new.W_pos.add_(W_pos.to(dtype)[:, None])
    return new
