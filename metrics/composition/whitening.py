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
token Gram matrix ``W_Eᵀ W_E`` (not centred over tokens; tokens only: measure 7, Snell 2024's
"analyse composition in the token basis"). The second also sees the directions earlier heads write into, such as a
previous-token head's output. The third is token space itself: for any form ``X`` on the residual
stream ``‖W_E X W_Eᵀ‖_F = ‖G^(1/2) X G^(1/2)‖_F`` with ``G = W_Eᵀ W_E``, so a Frobenius ratio
computed in this basis is the ratio of the ``[d_vocab, d_vocab]`` token-to-token maps.

With LayerNorm or RMSNorm the symmetry shrinks to rotations and a global scale (Snell 2024), under
which the plain ratios are already invariant; ``Σ`` is still taken over the pre-norm stream, so the
whitened ratio there is one more basis choice, not a fix of a symmetry. Under LayerNorm that stream
is taken as LayerNorm reads it, centred (:func:`~metrics.composition.circuits.centre_writing`), as
the writers are: ``Σ`` is then singular along the all-ones direction, which no centred weight reads
or writes, and :func:`fill_ones_direction` gives it a positive eigenvalue there that changes no score.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits, LowRank, centre_writing, metric_dtype
from models.transformer import AttentionOnlyTransformer, norm_centres


def fill_ones_direction(covariance: Tensor) -> Tensor:
    """``Σ + λ̄ 11ᵀ/d`` for ``Σ [d, d]`` a second moment of centred rows (``Σ 1 = 0``), ``λ̄ = tr Σ / (d - 1)``
    the mean of its other eigenvalues: the all-ones direction, Σ's null direction, gets ``λ̄``, so
    ``Σ^(±1/2)`` need no eigenvalue floor there and ``κ(Σ)`` is that of ``Σ`` on ``1⊥``.

    The value changes no score: ``1`` is an eigenvector, so ``Σ^(±1/2)`` map ``1⊥`` to itself and
    act on it as before, and every centred weight lies in ``1⊥`` (a reader ``1ᵀ R = 0``, a writer
    ``W 1 = 0``). Raised to the floor instead (:func:`symmetric_powers`), ``Σ^(-1/2)`` would scale that
    direction by up to 1e5 (1e3 in float32), and with it the rounding error of an eigenvector that is
    ``1`` only to rounding.
    """
    d = covariance.shape[-1]
    return covariance + covariance.diagonal().sum() / (max(d - 1, 1) * d)  # + λ̄/d in every entry: λ̄ 11ᵀ/d


def stream_covariance(
    norm: torch.nn.Module, parts: list[Tensor], dtype: torch.dtype, covariance: bool = True
) -> Tensor:
    """``Σ [d_model, d_model]``, the sum over ``parts`` (rows ``[..., d_model]`` each, e.g. ``W_E``)
    of their covariance, or (``covariance=False``) their mean second moment (the mean over rows not
    removed), in ``dtype``, on their device. Under LayerNorm (``norm``, a norm that reads the stream)
    the rows are taken as LayerNorm reads them, each minus its mean over ``d_model``
    (:func:`~metrics.composition.circuits.centre_writing`), and the all-ones direction is filled
    (:func:`fill_ones_direction`)."""
    sigma = 0
    for part in parts:
        rows = centre_writing(norm, part, dtype).reshape(-1, part.shape[-1])  # (N, d)
        sigma = sigma + (torch.cov(rows.T, correction=0) if covariance else rows.T @ rows / rows.shape[0])
    return fill_ones_direction(sigma) if norm_centres(norm) else sigma


def embedding_covariance(model: AttentionOnlyTransformer, dtype: torch.dtype | None = None) -> Tensor:
    """Covariance ``[d_model, d_model]`` of the stream layer 0 reads, ``W_E[t] + W_pos[p]`` over
    uniform independent ``t, p`` (every token id, every position): ``Cov(W_E rows) + Cov(W_pos rows)``,
    on the model's device. With shortformer positions the stream holds the tokens alone (positions
    reach only the queries' and keys' inputs), so ``Cov(W_E rows)``. Under LayerNorm that of the
    centred rows, ``C Σ C``, with the all-ones direction filled (:func:`stream_covariance`)."""
    parts = [model.W_E] if model.shape.positions == "shortformer" else [model.W_E, model.W_pos]
    return stream_covariance(model.final_norm, parts, metric_dtype(model, dtype))


def token_gram(model: AttentionOnlyTransformer, dtype: torch.dtype | None = None) -> Tensor:
    """The token embeddings' mean second moment ``W_Eᵀ W_E / d_vocab`` ``[d_model, d_model]`` (no
    positions; the mean over tokens not removed), on the model's device: the ``Σ`` of the token basis
    (measure 7). Under LayerNorm that of the centred embeddings ``W_E C``, ``C G C``, with the
    all-ones direction filled (:func:`stream_covariance`).

    The mean over tokens instead of the sum keeps it on the scale of :func:`embedding_covariance`;
    a global scale ``c`` of ``Σ`` cancels in every ratio (a QK circuit gains ``c``, in the product and
    in its own norm alike; an OV circuit nothing), so the token-space ratio is that of ``G = W_Eᵀ W_E``.
    """
    return stream_covariance(model.final_norm, [model.W_E], metric_dtype(model, dtype), covariance=False)


def residual_covariance(
    streams: list[Tensor], dtype: torch.dtype | None = None, norm: torch.nn.Module | None = None
) -> Tensor:
    """Covariance ``[d_model, d_model]`` of every row of the residual streams ``[batch, pos, d_model]``
    given (e.g. each layer's input on the probe batch), pooled, on their device, in ``dtype``
    (default: theirs, at least float32). ``norm``: a norm that reads the streams (the model's final
    norm); under LayerNorm the covariance of the centred rows, with the all-ones direction filled
    (:func:`stream_covariance`)."""
    dtype = dtype or torch.promote_types(streams[0].dtype, torch.float32)
    rows = torch.cat([s.reshape(-1, s.shape[-1]) for s in streams])  # (N, d)
    return stream_covariance(torch.nn.Identity() if norm is None else norm, [rows], dtype)


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
        scales spread, which bounds the rounding error of sums over them. On the CPU, in float64:
        MPS has no float64, and on CUDA a small eigendecomposition is serial and synchronises anyway."""
        roots = torch.linalg.eigvalsh(self.half.detach().to("cpu", torch.float64))
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
