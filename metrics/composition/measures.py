"""The composition measures (``docs/measures.md``), each a few lines over the same per-pair statistics.

Writer head h1 (layer l1) composes into reader head h2 (layer l2 > l1) through the products
(row-vector convention):

- Q: ``A B`` with ``A = W_OV¹``, ``B = W_QK²``     (h1 writes what h2's queries read)
- K: ``A B`` with ``B = W_QK²ᵀ``                   (h1 writes what h2's keys read)
- V: ``A B`` with ``B = W_OV²``                    (h1 writes what h2's values read)

Every measure is a function of :class:`PairStats`: with ``A = Σ_i σ_i(A) p_i u_iᵀ`` and
``B = Σ_j σ_j(B) v_j z_jᵀ`` (SVDs; ``u_i`` where A writes, ``v_j`` where B reads),

    ‖u_iᵀ B‖² = Σ_j σ_j(B)² (u_iᵀ v_j)²       (``row_energy``, one number per component of A)
    ‖A B‖_F²  = Σ_i σ_i(A)² ‖u_iᵀ B‖²

so a pair needs only the ``d_head x d_head`` matrix of cosines ``U_Aᵀ V_B`` and both spectra.
:mod:`metrics.composition.engine` computes these for every pair at once; :func:`aligned_pair_stats`
for aligned stacks of matrices (constructed examples, random baselines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from metrics.composition.circuits import LowRank

COMPOSITION_KINDS = ("Q", "K", "V")
NULL_COMPONENT = 1e-6  # a component of A with σ_i below this fraction of σ_1 writes nothing (rank < d_head)
VANISHING = 1e-24  # a squared Frobenius ratio below this: A B = 0 up to rounding


@dataclass(frozen=True)
class PairStats:
    """What every measure of writer A into reader B is computed from; fields broadcast together.

    ``row_energy [..., r_a]``: ``‖u_iᵀ B‖²`` for A's right singular vectors ``u_i`` (σ descending).
    ``writer_sq [..., r_a]``: ``σ_i(A)²``, descending. ``reader_sq [..., r_b]``: ``σ_j(B)²``, descending.
    ``cosine_mass [...]``: ``‖U_Aᵀ V_B‖_F² = Σ cos²θ`` over the principal angles between the span of
    A's rows (where it writes) and of B's columns (where it reads); None when not asked for.
    """

    row_energy: Tensor
    writer_sq: Tensor
    reader_sq: Tensor
    cosine_mass: Tensor | None = None

    def product_energy(self) -> Tensor:
        """``‖A B‖_F²``."""
        return (self.writer_sq * self.row_energy).sum(-1)


def frobenius_score(p: PairStats) -> Tensor:
    """``‖A B‖_F / (‖A‖_F ‖B‖_F)`` (Elhage et al. 2021). At most 1; about ``d_model^-1/2`` for
    random matrices; never 1 for rank > 1 (aslvrstn 2022: the identity scores ``d^-1/2``)."""
    return (p.product_energy() / (p.writer_sq.sum(-1) * p.reader_sq.sum(-1))).sqrt()


def singular_value_bound_score(p: PairStats) -> Tensor:
    """``‖A B‖_F / sqrt(Σ_i σ↓_i(A)² σ↓_i(B)²)`` (Turner & Strand, in Lieberum 2022): the tight
    von Neumann bound as denominator, the shorter spectrum zero-padded. 1 exactly when A's top write
    directions are B's top read directions, in the same order."""
    r = min(p.writer_sq.shape[-1], p.reader_sq.shape[-1])
    bound = (p.writer_sq[..., :r] * p.reader_sq[..., :r]).sum(-1)
    return (p.product_energy() / bound).sqrt()


def subspace_score(p: PairStats) -> Tensor:
    """``Σ cos²θ_i / r`` (Snell 2024, "Composition and Subspaces"; projection kernel of Yamagiwa et al. 2026) between the
    writer's write subspace (row space of ``W_O¹``) and the reader's read subspace (column space of
    ``W_Q²``, ``W_K²`` or ``W_V²``); ``r`` the smaller dimension. In ``[0, 1]``; ``r / d_model`` at random."""
    return p.cosine_mass / min(p.writer_sq.shape[-1], p.reader_sq.shape[-1])


def component_scores(p: PairStats) -> tuple[Tensor, Tensor]:
    """Per rank-1 SVD component ``A_i = σ_i p_i u_iᵀ`` of A (Merullo et al. 2024, "Talking Heads"):
    its Frobenius ratio with B, ``‖u_iᵀ B‖ / ‖B‖``, and its share ``‖A_i B‖² / ‖A B‖²`` (the
    components' products are orthogonal, so shares sum to 1). Both ``[..., r_a]``.

    A component with ``σ_i <= NULL_COMPONENT σ_1`` writes nothing and scores 0 with share 0; shares
    are NaN when ``A B`` vanishes (nothing to split).
    """
    null = p.writer_sq <= NULL_COMPONENT**2 * p.writer_sq[..., :1]
    scores = torch.where(null, 0.0, (p.row_energy / p.reader_sq.sum(-1, keepdim=True)).sqrt())
    energy = torch.where(null, 0.0, p.writer_sq * p.row_energy)
    total = energy.sum(-1, keepdim=True)
    vanishing = total <= VANISHING * p.writer_sq.sum(-1, keepdim=True) * p.reader_sq.sum(-1, keepdim=True)
    return scores, torch.where(vanishing, torch.nan, energy / total)


def best_component_score(p: PairStats) -> Tensor:
    """The best rank-1 component's Frobenius ratio with the reader."""
    return component_scores(p)[0].max(-1).values


def best_component_share_score(p: PairStats) -> Tensor:
    """The best component's share of ``‖A B‖_F²``: near 1 when one direction carries the composition."""
    scores, shares = component_scores(p)
    return shares.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


Basis = Literal["raw", "embedding", "residual", "token"]
"""Residual bases a measure is computed in: as the weights stand, or whitened by the covariance of
the embeddings, by that of the residual stream observed on the probe, or by the token embeddings'
uncentred Gram matrix ``W_Eᵀ W_E`` (token space) (:mod:`metrics.composition.whitening`)."""


@dataclass(frozen=True)
class Measure:
    """A weight-based composition measure: a score of :class:`PairStats`, computed in a residual ``basis``.

    Called on aligned stacks ``(writer [P], reader [P])`` of :class:`LowRank` it scores each pair
    ``A = writer[p]``, ``B = reader[p]`` (in the given coordinates, whatever the basis) -> ``[P]``.
    Every weight-based measure of a model is computed in one batched pass
    (:func:`~metrics.composition.scores.composition_of`) and has a random baseline
    (:mod:`metrics.composition.baseline`).
    """

    name: str
    score: Callable[[PairStats], Tensor]
    basis: Basis = "raw"
    needs_cosine_mass: bool = False

    def __call__(self, writer: LowRank, reader: LowRank) -> Tensor:
        return self.score(aligned_pair_stats(writer, reader))


class DataMeasure:
    """A data-aware composition measure: it reads the probe pass, not only the weights, and has no
    random baseline. Subclass it with ``name``, ``Options`` (a dataclass of its options, or None;
    they are ``tracker.NAME.*``), :meth:`scores` and, if it logs more than its scores, :meth:`outputs`;
    register an instance with :func:`register_measure`."""

    name: str = ""
    Options: type | None = None

    def scores(self, run, options) -> tuple[dict[str, Tensor], object]:
        """``({kind: [L, H, L, H]}, extra)`` for Q, K and V on ``run`` (a
        :class:`~metrics.tracked.base.ProbeRun`); ``extra`` is handed to :meth:`outputs`."""
        raise NotImplementedError

    def outputs(self, extra, run) -> list:
        """What the records write besides its scores (:mod:`metrics.tracked.base` output types)."""
        return []


MEASURES: dict[str, Measure | DataMeasure] = {}
"""Every composition measure the tracker can score (``tracker.measures``), by name: the weight-based
ones and the data-aware ones, the built-in ones and the extensions'."""
WEIGHT_MEASURES: dict[str, Measure] = {}
"""The weight-based ones among :data:`MEASURES`."""


def register_measure(measure: Measure | DataMeasure) -> Measure | DataMeasure:
    """Add ``measure`` to :data:`MEASURES` (and, if weight-based, :data:`WEIGHT_MEASURES`): one call in
    the measure's module is all a new measure needs."""
    if not measure.name or not measure.name.isidentifier():
        raise ValueError(f"a measure's name must be an identifier, got {measure.name!r}")
    known = MEASURES.get(measure.name)
    if known is not None and known != measure:
        raise ValueError(f"a measure named {measure.name!r} is registered already")
    MEASURES[measure.name] = measure
    if isinstance(measure, Measure):
        WEIGHT_MEASURES[measure.name] = measure
    return measure


frobenius_ratio = register_measure(Measure("frobenius", frobenius_score))
singular_value_bound_ratio = register_measure(Measure("sv_bound", singular_value_bound_score))
register_measure(Measure("whitened", frobenius_score, basis="embedding"))
register_measure(Measure("whitened_resid", frobenius_score, basis="residual"))
register_measure(Measure("token_space", frobenius_score, basis="token"))
subspace_overlap = register_measure(Measure("subspace", subspace_score, needs_cosine_mass=True))
best_component_ratio = register_measure(Measure("component", best_component_score))
best_component_share = register_measure(Measure("component_share", best_component_share_score))
# the built-in weight-based measures, in docs/measures.md's order; the data-aware share is registered by
# metrics/tracked/composition.py (metrics.tracked.base.registered_measures lists them all)


@dataclass(frozen=True)
class Spectra:
    """An orthonormal basis ``[..., d_model, r]`` of singular vectors and the squared singular values
    ``[..., r]`` (descending) of a stack of low-rank matrices."""

    basis: Tensor
    sq: Tensor


def principal_core(left: Tensor, right: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """QRs ``left = Q_l T_l``, ``right = Q_r T_r`` (``[..., d, r]``) and the ``r x r`` SVD
    ``T_l T_rᵀ = P diag(S) Whᵀ``, so that ``left @ right.mT = (Q_l P) diag(S) (Q_r Whᵀ)ᵀ``.
    Returns ``(Q_l, Q_r, (P, S, Wh))``."""
    q_left, t_left = torch.linalg.qr(left)
    q_right, t_right = torch.linalg.qr(right)
    return q_left, q_right, torch.linalg.svd(t_left @ t_right.mT)


def writer_spectra(writer: LowRank) -> Spectra:
    """A's right singular vectors (where it writes) and ``σ(A)²``."""
    _, q_right, (_, s, wh) = principal_core(writer.left, writer.right)
    return Spectra(q_right @ wh.mT, s.square())


def reader_spectra(reader: LowRank) -> Spectra:
    """B's left singular vectors (where it reads) and ``σ(B)²``."""
    q_left, _, (p, s, _) = principal_core(reader.left, reader.right)
    return Spectra(q_left @ p, s.square())


def stats_from_cosines(cosines: Tensor, writer_sq: Tensor, reader_sq: Tensor, cosine_mass: bool = True) -> PairStats:
    """:class:`PairStats` from the cosines ``U_Aᵀ V_B [..., r_a, r_b]`` and both squared spectra."""
    cos2 = cosines.square()
    row_energy = (cos2 * reader_sq[..., None, :]).sum(-1)
    return PairStats(row_energy, writer_sq, reader_sq, cos2.sum((-1, -2)) if cosine_mass else None)


def aligned_pair_stats(writer: LowRank, reader: LowRank) -> PairStats:
    """:class:`PairStats` of aligned stacks ``A = writer[p]``, ``B = reader[p]`` -> fields ``[P, ...]``."""
    a, b = writer_spectra(writer), reader_spectra(reader)
    return stats_from_cosines(a.basis.mT @ b.basis, a.sq, b.sq)
