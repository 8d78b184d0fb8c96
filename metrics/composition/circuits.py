"""Per-head QK and OV circuits as low-rank factor pairs (Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits"), in the row-vector convention of MEASURES.md.

A ``[d_model, d_model]`` circuit of rank <= d_head is never formed: it is kept as
``left @ right.mT`` with ``left, right [..., d_model, d_head]``.
"""

from __future__ import annotations

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
    Normalization gains are folded into the reading weights ``W_Q, W_K, W_V``.
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
            W_Q.append(fold(layer.W_Q))
            W_K.append(fold(layer.W_K))
            W_V.append(fold(layer.W_V))
            W_O.append(layer.W_O)
        stack = lambda ws: weight(torch.stack(ws), dtype)  # (n_layers, n_heads, ...)
        W_Q, W_K, W_V, W_O = stack(W_Q), stack(W_K), stack(W_V), stack(W_O)
    return HeadCircuits(qk=LowRank(W_Q, W_K).with_triangles(), ov=LowRank(W_V, W_O.mT).with_triangles())
