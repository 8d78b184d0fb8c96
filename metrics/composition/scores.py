"""Composition of a model: every requested measure for every head pair, each in its residual basis."""

from __future__ import annotations

import torch
from torch import Tensor

from metrics.composition.circuits import HeadCircuits, LowRank, head_circuits
from metrics.composition.engine import DEFAULT_CHUNK_BYTES, composition_scores, uses_gram_products
from metrics.composition.measures import WEIGHT_MEASURES, frobenius_score
from metrics.composition.whitening import Whitening, embedding_covariance, residual_covariance, token_gram, whiten
from models.transformer import AttentionOnlyTransformer

GRAM_ROUNDING = 1e-4
"""The largest ``κ(Σ)·eps`` of a whitened basis scored through the engine's Gram path: measured,
its float32 relative error is ~0.1 κ·eps (6.7e-3 at κ = 1e6), so this keeps it near 1e-5."""


def basis_whitening(
    model: AttentionOnlyTransformer, basis: str, residual: list[Tensor] | None, dtype: torch.dtype | None
) -> Whitening:
    """The whitening of ``basis``: by the embeddings' covariance, the token embeddings' Gram matrix
    (token space), or the residual stream's covariance on the probe (under LayerNorm each of the
    centred rows, :func:`~metrics.composition.whitening.stream_covariance`)."""
    if basis == "embedding":
        return Whitening.of(embedding_covariance(model, dtype))
    if basis == "token":
        return Whitening.of(token_gram(model, dtype))
    if basis != "residual":
        raise ValueError(f"unknown residual basis {basis!r}")
    if residual is None:
        raise ValueError("the residual basis needs the residual stream observed on a probe batch")
    return Whitening.of(residual_covariance(residual, dtype, model.final_norm))


def composition_of(
    model: AttentionOnlyTransformer,
    measures: tuple[str, ...],
    circuits: HeadCircuits | None = None,
    residual: list[Tensor] | None = None,
    dtype: torch.dtype | None = None,
    whitenings: dict[str, Whitening] | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[str, dict[str, Tensor]]:
    """``{measure: {kind: [n_layers, n_heads, n_layers, n_heads]}}`` for the named measures (NaN where
    the reader is not later), on the model's device, in ``dtype`` (default: the model's, at least
    float32; float64 is the exact path).

    ``circuits``: ``head_circuits(model, dtype)`` if the caller has it already. ``residual``: each
    layer's input ``[batch, pos, d_model]`` on the probe, for ``whitened_resid`` (``whitened`` and
    ``token_space`` need only the model's embeddings). ``whitenings``:
    ``{basis: Whitening}`` to use instead of computing them; filled in with those computed here (a
    tracker reuses them between refreshes).
    """
    unknown = set(measures) - set(WEIGHT_MEASURES)
    if unknown:
        raise ValueError(f"unknown composition measures {sorted(unknown)}; known: {sorted(WEIGHT_MEASURES)}")
    if not measures:
        return {}
    circuits = head_circuits(model, dtype) if circuits is None else circuits
    dtype = circuits.qk.left.dtype
    by_basis: dict[str, list[str]] = {}
    for m in measures:
        by_basis.setdefault(WEIGHT_MEASURES[m].basis, []).append(m)
    bases = {}
    for basis in by_basis:
        bases[basis] = circuits
        if basis != "raw":
            if whitenings is None:
                whitenings = {}
            if basis not in whitenings:
                whitenings[basis] = basis_whitening(model, basis, residual, dtype)
            bases[basis] = whiten(circuits, whitenings[basis])
    scores: dict[str, dict[str, Tensor]] = {}
    for group in basis_groups(by_basis, circuits, max_chunk_bytes):
        stacked = HeadCircuits(
            qk=LowRank(*(torch.stack([getattr(bases[b].qk, side) for b in group]) for side in ("left", "right"))),
            ov=LowRank(*(torch.stack([getattr(bases[b].ov, side) for b in group]) for side in ("left", "right"))),
        )
        names = tuple(m for b in group for m in by_basis[b])
        measures_ = tuple(WEIGHT_MEASURES[m] for m in names)
        # the Gram path sums products of whitened weights: accurate while the basis is well conditioned
        gram_path = all(m.score is frobenius_score for m in measures_) and uses_gram_products(
            *circuits.qk.left.shape[-2:]
        )
        well_conditioned = gram_path and all(
            b == "raw" or whitenings[b].condition * torch.finfo(dtype).eps <= GRAM_ROUNDING for b in group
        )
        by_measure = composition_scores(
            stacked, measures_, max_chunk_bytes=max_chunk_bytes, allow_gram=well_conditioned
        )
        for m in names:
            index = group.index(WEIGHT_MEASURES[m].basis)
            scores[m] = {kind: values[index] for kind, values in by_measure[m].items()}
    return {m: scores[m] for m in measures}


def basis_groups(by_basis: dict[str, list[str]], circuits: HeadCircuits, max_chunk_bytes: int) -> list[list[str]]:
    """Bases scored together: on small models every basis in one batched pass (a few large calls
    instead of many small ones); when the factorised weights of all of them would take more than
    a quarter of ``max_chunk_bytes``, one basis at a time (memory stays bounded). (Splitting the
    Frobenius-only bases off to the engine's Gram path was measured slower at 2 × 2 × 64 × 16 and at
    4 × 8 × 256 × 32; alone, at paper scale, a basis takes that path by itself.)"""
    factor = circuits.qk.left
    per_basis = 12 * factor.numel() * factor.element_size()  # four weights, their Q factors, the bases
    if len(by_basis) * per_basis <= max_chunk_bytes // 4:
        return [list(by_basis)]
    return [[b] for b in by_basis]
