"""The whitened (GL-invariant) bases of the residual stream (docs/measures.md measures 4 and 7; the ways
out of Snell 2024's Axiom-4 problem).

Without normalization, ``x -> x T`` for any invertible ``T`` (writers ``W -> W T``, readers
``W -> T⁻¹ W``, ``W_E, W_pos -> W_E T, W_pos T``) leaves the model's function unchanged but changes
the Frobenius ratio. With ``Σ`` the covariance of the layer-0 residual input, the map to the basis
where that input is isotropic, ``Σ^(-1/2)``, satisfies ``T (Tᵀ Σ T)^(-1/2) = Σ^(-1/2) R`` with R
orthogonal, so every rotation-invariant score computed there is invariant to every ``T``.

Three choices of ``Σ``, all covariant (``Σ -> Tᵀ Σ T``), so all give invariant scores:
the embedding covariance (the layer-0 input over every token and position), the observed
residual stream on the probe batch, every layer's input pooled (Snell 2024's "way out" 1), and the
token Gram matrix ``W_Eᵀ W_E`` (uncentred, tokens only: measure 7, Snell 2024's "analyse composition
in the token basis"). The second also sees the directions earlier heads write into, such as a
previous-token head's output. The third is token space itself: for any form ``X`` on the residual
stream ``‖W_E X W_Eᵀ‖_F = ‖G^(1/2) X G^(1/2)‖_F`` with ``G = W_Eᵀ W_E``, so a Frobenius ratio
computed in this basis is the ratio of the ``[d_vocab, d_vocab]`` token-to-token maps.

With LayerNorm or RMSNorm the symmetry shrinks to rotations and a global scale (Snell 2024), under
which the plain ratios are already invariant; ``Σ`` is still taken over the raw (pre-norm)
stream, so the whitened ratio there is one more basis choice, not a fix of a symmetry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits, LowRank, metric_dtype, weight
from models.transformer import AttentionOnlyTransformer


def embedding_covariance(model: AttentionOnlyTransformer, dtype: torch.dtype | None = None) -> Tensor:
    """Covariance ``[d_model, d_model]`` of the stream layer 0 reads, ``W_E[t] + W_pos[p]`` over
    uniform independent ``t, p`` (every token id, every position): ``Cov(W_E rows) + Cov(W_pos rows)``,
    on the model's device. With shortformer positions the stream holds the tokens alone (positions
    reach only the queries' and keys' inputs), so ``Cov(W_E rows)``."""
    dtype = metric_dtype(model, dtype)
    cov = lambda rows: torch.cov(weight(rows, dtype).T, correction=0)
    return cov(model.W_E) if model.shape.positions == "shortformer" else cov(model.W_E) + cov(model.W_pos)


def token_gram(model: AttentionOnlyTransformer, dtype: torch.dtype | None = None) -> Tensor:
    """The token embeddings' uncentred second moment ``W_Eᵀ W_E / d_vocab`` ``[d_model, d_model]``
    (no positions, no centring), on the model's device: the ``Σ`` of the token basis (measure 7).

    The mean over tokens instead of the sum keeps it on the scale of :func:`embedding_covariance`;
    a global scale ``c`` of ``Σ`` cancels in every ratio (a QK circuit gains ``c``, in the product and
    in its own norm alike; an OV circuit nothing), so the token-space ratio is that of ``G = W_Eᵀ W_E``.
    """
    W_E = weight(model.W_E, metric_dtype(model, dtype))
    return W_E.T @ W_E / W_E.shape[0]


def residual_covariance(streams: list[Tensor], dtype: torch.dtype | None = None) -> Tensor:
    """Covariance ``[d_model, d_model]`` of every row of the residual streams ``[batch, pos, d_model]``
    given (e.g. each layer's input on the probe batch), pooled, on their device, in ``dtype``
    (default: theirs, at least float32)."""
    dtype = dtype or torch.promote_types(streams[0].dtype, torch.float32)
    rows = torch.cat([weight(s, dtype).reshape(-1, s.shape[-1]) for s in streams])  # (N, d)
    return torch.cov(rows.T, correction=0)


def symmetric_powers(covariance: Tensor, eps: float | None = None) -> tuple[Tensor, Tensor]:
    """``(Σ^(1/2), Σ^(-1/2))``; eigenvalues below ``eps · λ_max`` are raised to it (default 1e-10 in
    float64; in float32, where smaller eigenvalues are rounding noise, 1e-6)."""
    if eps is None:
        eps = 1e-10 if covariance.dtype == torch.float64 else 1e-6
    values, vectors = torch.linalg.eigh(covariance)
    values = values.clamp(min=eps * values.max())
    root = values.sqrt()
    return (vectors * root) @ vectors.T, (vectors / root) @ vectors.T


def left_multiply(matrix: Tensor, factors: Tensor) -> Tensor:
    """``matrix @ factors`` for ``[d, d]`` and a stack ``[..., d, r]``, as one 2-D GEMM
    ``[d, d] @ [d, (...) r]`` (a broadcast batched matmul is several times slower)."""
    d, r = factors.shape[-2:]
    flat = factors.movedim(-2, 0).reshape(d, -1)  # (d, (...) r)
    return (matrix @ flat).reshape(d, *factors.shape[:-2], r).movedim(0, -2)


@dataclass(frozen=True)
class Whitening:
    """The maps to and from the whitened basis of a covariance ``Σ``: ``half = Σ^(1/2)``,
    ``inverse_half = Σ^(-1/2)`` (``[d_model, d_model]`` each). A tracker keeps one between refreshes."""

    half: Tensor
    inverse_half: Tensor

    @classmethod
    def of(cls, covariance: Tensor) -> Whitening:
        return cls(*symmetric_powers(covariance))

    @functools.cached_property
    def condition(self) -> float:
        """``κ(Σ) = λ_max / λ_min`` of the (regularised) covariance: how much the whitened weights'
        scales spread, which bounds the rounding error of sums over them."""
        roots = torch.linalg.eigvalsh(self.half.double())
        return float((roots.max() / roots.min().clamp_min(torch.finfo(torch.float64).tiny)) ** 2)


def whiten(circuits: HeadCircuits, covariance: Tensor | Whitening) -> HeadCircuits:
    """Express every circuit in the whitened basis ``x̃ = x Σ^(-1/2)``.

    Readers ``W -> Σ^(1/2) W`` (``W_Q, W_K, W_V``); writers ``W_O -> W_O Σ^(-1/2)``.
    """
    w = covariance if isinstance(covariance, Whitening) else Whitening.of(covariance)
    like = circuits.qk.left  # a basis restored from a checkpoint may sit on another device
    half, inverse_half = w.half.to(like), w.inverse_half.to(like)
    read = lambda w: left_multiply(half, w)
    qk = LowRank(read(circuits.qk.left), read(circuits.qk.right))
    ov = LowRank(read(circuits.ov.left), left_multiply(inverse_half, circuits.ov.right))
    return HeadCircuits(qk=qk, ov=ov)
