"""Per-head QK and OV circuits as low-rank factor pairs (Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits"), in the row-vector convention of ``docs/measures.md``.

A ``[d_model, d_model]`` circuit of rank <= d_head is never formed: it is kept as
``left @ right.mT`` with ``left, right [..., d_model, d_head]``. Circuits stay on the model's
device, in the model's dtype (at least float32) unless a dtype is asked for: float64 is the exact
reference path the tests use.

Normalization is folded into the weights that read the normalized stream (:func:`fold_norm`): the
gain always, and under LayerNorm also the centring ``x -> x - mean(x)``, a linear map, as
TransformerLens's ``fold_ln`` with ``center_weights`` does. What is left of the norm is a division
by one positive scalar per position, not a map of the residual space. Under LayerNorm the weights
that write into the stream are centred too (:func:`centre_writing`), as TransformerLens's
``center_writing_weights`` does: no reader sees a write's component along the all-ones direction,
so no score should (docs/measures.md, "Folding normalization").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.transformer import AttentionOnlyTransformer, norm_centres, norm_gain


@dataclass(frozen=True)
class LowRank:
    """A stack of ``d_model x d_model`` matrices ``left @ right.mT``; ``left, right [..., d_model, rank]``."""

    left: Tensor
    right: Tensor

    def dense(self) -> Tensor:
        """The full matrices ``[..., d_model, d_model]``: for tests and references only."""
        return self.left @ self.right.mT

    @property
    def T(self) -> LowRank:
        return LowRank(self.right, self.left)

    def map(self, fn) -> LowRank:
        """Apply ``fn`` to both factors (e.g. flatten or index the head dimensions)."""
        return LowRank(fn(self.left), fn(self.right))

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
    The layer's normalization is folded into the reading weights ``W_Q, W_K, W_V`` (:func:`fold_norm`);
    under LayerNorm ``W_O`` is centred (:func:`centre_writing`).
    """

    qk: LowRank
    ov: LowRank

    @property
    def n_layers(self) -> int:
        return self.qk.left.shape[0]

    @property
    def n_heads(self) -> int:
        return self.qk.left.shape[1]


def metric_dtype(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """``dtype`` if given, else the model's parameter dtype promoted to at least float32 (a bf16
    or fp16 model is measured in float32)."""
    if dtype is not None:
        return dtype
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def weight(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """A parameter detached, on its own device, in ``dtype``: metrics compute where the model lives."""
    return tensor.detach().to(dtype)


def fold_norm(norm: torch.nn.Module, reading: Tensor, dtype: torch.dtype) -> Tensor:
    """``reading [..., d_model, k]``, a weight that reads the output of ``norm``, with the norm's
    linear part folded in: ``C diag(g) W`` in ``dtype``, detached.

    ``g`` is the gain (none without normalization). ``C = I - 11ᵀ/d_model`` is LayerNorm's centring
    (the identity under RMSNorm or no normalization): symmetric, so ``x C`` for a row ``x`` is
    ``x - mean(x)``, and ``C W`` subtracts from ``W`` its mean over the ``d_model`` axis. The
    weight is cast before folding, so the float64 path folds in float64.
    """
    reading = weight(reading, dtype)
    gain = norm_gain(norm)
    if gain is None:
        return reading
    folded = weight(gain, dtype)[:, None] * reading
    return folded - folded.mean(-2, keepdim=True) if norm_centres(norm) else folded


def centre_writing(norm: torch.nn.Module, writing: Tensor, dtype: torch.dtype) -> Tensor:
    """``writing [..., d_model]``, rows written into the residual stream (a head's ``W_O``, ``W_E``,
    ``W_pos``, or the stream itself), in ``dtype``, detached; under LayerNorm ``W C``: each row minus
    its mean over ``d_model``, as TransformerLens's ``center_writing_weights`` does
    (``W_O - W_O.mean(-1, keepdim=True)``; docs/measures.md, "Folding normalization").

    ``norm`` is a normalization that reads the stream (the model's final norm: every write reaches
    it, and a model's norms are all of one kind). LayerNorm reads ``x C`` only, ``LN(x + a 1) = LN(x)``,
    so ``W`` and ``W + c 1ᵀ`` (any ``c``, one constant a row) are the same model: the centred ``W C``
    is the same for both. Every folded reader ``R`` has ``C R = R``, so a product ``W C R = W R`` is
    unchanged (``C² = C``); what the centring removes is the invisible component's share of norms,
    spectra and subspaces. Under RMSNorm or no normalization nothing is centred:
    ``rms(x + a 1) != rms(x)``, so there ``W + c 1ᵀ`` is another model.
    """
    writing = weight(writing, dtype)
    return writing - writing.mean(-1, keepdim=True) if norm_centres(norm) else writing


def head_circuits(model: AttentionOnlyTransformer, dtype: torch.dtype | None = None) -> HeadCircuits:
    """The model's QK and OV circuits, detached, on the model's device, in ``metric_dtype(model, dtype)``."""
    dtype = metric_dtype(model, dtype)
    W_Q, W_K, W_V, W_O = [], [], [], []
    with torch.no_grad():
        for layer in model.layers:
            W_Q.append(fold_norm(layer.norm, layer.W_Q, dtype))
            W_K.append(fold_norm(layer.norm, layer.W_K, dtype))
            W_V.append(fold_norm(layer.norm, layer.W_V, dtype))
            W_O.append(centre_writing(model.final_norm, layer.W_O, dtype))
        W_Q, W_K, W_V, W_O = (torch.stack(ws) for ws in (W_Q, W_K, W_V, W_O))  # (n_layers, n_heads, ...)
    return HeadCircuits(qk=LowRank(W_Q, W_K), ov=LowRank(W_V, W_O.mT))
