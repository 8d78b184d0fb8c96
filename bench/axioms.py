"""docs/measures.md's axioms as executable checks (Lieberum 2022; Snell 2024, "Why Is Measuring Composition So Difficult?").

Axioms 1-3 on constructed writer/reader matrices in ``d_model = 12`` with rank 3:
1. aligned -> 1 where a measure promises it (A writes only where B reads, same order);
2. orthogonal -> 0 (B reads nothing A writes);
3. smooth and monotone as A's write subspace rotates from aligned (θ = 0) to orthogonal (θ = π/2).

Axiom 4 on a model: each function-preserving reparametrisation (residual rotation, residual GL,
head-internal GL of OV and of QK, a shift of the embeddings between tokens and positions; under
LayerNorm a rotation that fixes the all-ones direction, and a shift of every writer's rows along it)
must leave the logits unchanged (checked first, in float64); then each measure, and the copying and
matching scores, is reported invariant or not, by the largest change of any pair's (head's) score.

On constructed matrices the whitened ratios (``token_space`` too) are Frobenius in an isotropic basis
(Σ = I); on models they whiten as the tracker does (embedding covariance; token Gram ``W_Eᵀ W_E``;
residual stream on ``tokens``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.reparametrize import (
    embedding_shift,
    ones_shift,
    query_key_transform,
    residual_transform,
    rotation_fixing_ones,
    value_output_transform,
)
from metrics.composition.circuits import LowRank, head_circuits
from metrics.composition.data_shares import SHARE, data_shares
from metrics.composition.measures import WEIGHT_MEASURES, Measure
from metrics.composition.scores import composition_of
from metrics.heads.circuit_scores import MATCHING, copying_scores, matching_scores
from models.transformer import AttentionOnlyTransformer, norm_centres

COPYING = "ov_copying"  # the OV circuit's copying score (heads/ov_copying)
"""The weight copying score's name beside the composition measures and ``match`` in axiom 4."""

LOGIT_TOLERANCE = 1e-5  # a reparametrisation must move no logit by more (float64)
INVARIANCE_TOLERANCE = 1e-8  # a measure is invariant when no pair's score moves by more
PATH_POINTS = 31  # angles from aligned to orthogonal, for axiom 3
D_MODEL, RANK = 12, 3


@dataclass(frozen=True)
class ConstructedScores:
    """A measure on constructed matrices. ``rotation_path [PATH_POINTS]``: its score as A's write
    subspace rotates from B's read subspace (θ = 0) to an orthogonal one (θ = π/2)."""

    aligned_rank_one: float
    aligned: float  # rank 3, singular values ordered alike
    orthogonal: float
    rotation_path: Tensor

    @property
    def monotone(self) -> bool:
        """Never rises along the path (within rounding) and stays defined."""
        steps = self.rotation_path.diff()
        return bool(self.rotation_path.isfinite().all() and (steps <= 1e-12).all())

    @property
    def smooth(self) -> bool:
        """No jump: no step along the evenly spaced path exceeds 3× the mean step."""
        steps = self.rotation_path.diff().abs()
        return bool(self.rotation_path.isfinite().all() and steps.max() <= 3 * steps.mean() + 1e-12)


def constructed_pairs(seed: int = 0) -> dict[str, tuple[LowRank, LowRank]]:
    """Writer/reader pairs ``(A, B)`` as ``[1]``-stacks: ``aligned_rank_one``, ``aligned``,
    ``orthogonal``, and ``rotated_{i}`` for each angle of the rotation path.

    A writes (row space) along ``shared``; B reads (column space) along ``shared``, with singular
    values (3, 2, 1) and (5, 0.5, 0.1) in the same order; the orthogonal B reads along ``away``.
    """
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(D_MODEL, D_MODEL, generator=g, dtype=torch.float64)).Q
    into, shared, out, away = (basis[:, i * RANK : (i + 1) * RANK] for i in range(4))
    s_a = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    s_b = torch.tensor([5.0, 0.5, 0.1], dtype=torch.float64)
    writer = lambda writes, k=RANK: LowRank((into * s_a)[None, :, :k], writes[None, :, :k])  # A = into diag(s) writesᵀ
    reader = lambda reads, k=RANK: LowRank((reads * s_b)[None, :, :k], out[None, :, :k])  # B = reads diag(s) outᵀ
    pairs = {
        "aligned_rank_one": (writer(shared, 1), reader(shared, 1)),
        "aligned": (writer(shared), reader(shared)),
        "orthogonal": (writer(shared), reader(away)),
    }
    for i, theta in enumerate(torch.linspace(0, math.pi / 2, PATH_POINTS, dtype=torch.float64).tolist()):
        pairs[f"rotated_{i}"] = (writer(math.cos(theta) * shared + math.sin(theta) * away), reader(shared))
    return pairs


def constructed_scores(measure: Measure, seed: int = 0) -> ConstructedScores:
    """Axioms 1-3 for one pair measure."""
    score = {name: float(measure(a, b)) for name, (a, b) in constructed_pairs(seed).items()}
    path = torch.tensor([score[f"rotated_{i}"] for i in range(PATH_POINTS)], dtype=torch.float64)
    return ConstructedScores(score["aligned_rank_one"], score["aligned"], score["orthogonal"], path)


def reparametrisations(model: AttentionOnlyTransformer, seed: int = 0) -> dict[str, AttentionOnlyTransformer]:
    """docs/measures.md axiom 4's function-preserving maps, each with a random, well-conditioned matrix.

    Under LayerNorm the rotation fixes the all-ones direction (:func:`rotation_fixing_ones`; a
    symmetry with unit gains), and one more map moves every writer's rows along that direction
    (``ones shift``: every head's ``W_O``, ``W_E``, and ``W_pos`` unless shortformer)."""
    g = torch.Generator().manual_seed(seed)
    s = model.shape
    dtype = model.W_E.dtype
    layernorm = norm_centres(model.final_norm)
    gaussian = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)
    rotation = (
        rotation_fixing_ones(s.d_model, g, dtype) if layernorm else torch.linalg.qr(gaussian(s.d_model, s.d_model)).Q
    )
    general = gaussian(s.d_model, s.d_model) / s.d_model**0.5 + torch.eye(s.d_model, dtype=dtype)
    per_head = lambda: (
        gaussian(s.n_layers, s.n_heads, s.d_head, s.d_head) / s.d_head**0.5 + torch.eye(s.d_head, dtype=dtype)
    )
    maps = {
        "residual rotation": residual_transform(model, rotation),
        "residual GL": residual_transform(model, general),
        "head GL (V, O)": value_output_transform(model, per_head()),
        "head GL (Q, K)": query_key_transform(model, per_head()),
        "embedding shift": embedding_shift(model, 2 * gaussian(s.d_model) * model.W_E.detach().std()),
    }
    if layernorm:
        scale = lambda w: 2 * float(w.detach().std())  # shifts well above the rows' own means
        maps["ones shift"] = ones_shift(
            model,
            W_O=gaussian(s.n_layers, s.n_heads, s.d_head) * scale(model.layers[0].W_O),
            W_E=gaussian(s.d_vocab) * scale(model.W_E),
            W_pos=None if s.positions == "shortformer" else gaussian(s.n_ctx) * scale(model.W_pos),
        )
    return maps


def pair_scores(model: AttentionOnlyTransformer, measures: tuple[str, ...], tokens: Tensor) -> dict[str, Tensor]:
    """Every scored pair and kind of each measure, flattened, plus the QK matching score of every pair
    and the copying score of every head."""
    circuits = head_circuits(model)
    cache = model.run_with_cache(tokens, head_out=False)[1]
    flat = lambda t: t[~t.isnan()]
    weighed = tuple(m for m in measures if m in WEIGHT_MEASURES)
    by_measure = composition_of(model, weighed, circuits, cache["resid_pre"])
    if SHARE in measures:  # every position of every sequence weighs
        weights = torch.ones(tokens.shape[-1], dtype=model.W_E.dtype, device=tokens.device)
        by_measure[SHARE] = data_shares(model, tokens, cache, weights).heads
    scores = {m: torch.cat([flat(s) for s in by_kind.values()]) for m, by_kind in by_measure.items()}
    scores[MATCHING] = flat(matching_scores(model, circuits))
    scores[COPYING] = copying_scores(model, circuits).flatten()
    return scores


@dataclass(frozen=True)
class Invariance:
    """One reparametrisation: how far the logits moved, and each measure's largest score change."""

    logit_change: float
    score_change: dict[str, float]

    @property
    def function_preserved(self) -> bool:
        return self.logit_change <= LOGIT_TOLERANCE

    def invariant(self, measure: str) -> bool:
        return self.score_change[measure] <= INVARIANCE_TOLERANCE


@dataclass(frozen=True)
class AxiomTable:
    constructed: dict[str, ConstructedScores]  # measure -> axioms 1-3
    invariance: dict[str, Invariance]  # reparametrisation -> axiom 4


@torch.no_grad()
def axiom_table(
    model: AttentionOnlyTransformer,
    tokens: Tensor,
    measures: tuple[str, ...] = (*WEIGHT_MEASURES, SHARE),
    seed: int = 0,
) -> AxiomTable:
    """Axioms 1-3 for each measure, and axiom 4 for each measure and the matching and copying scores
    on a float64 copy of ``model`` (logits compared on ``tokens [batch, pos]``)."""
    model = copy.deepcopy(model).double().eval()
    logits, before = model(tokens), pair_scores(model, measures, tokens)
    invariance = {}
    for name, transformed in reparametrisations(model, seed).items():
        after = pair_scores(transformed, measures, tokens)
        invariance[name] = Invariance(
            logit_change=float((transformed(tokens) - logits).abs().max()),
            score_change={m: float((after[m] - before[m]).abs().max()) for m in before},
        )
    constructed = {m: constructed_scores(WEIGHT_MEASURES[m], seed) for m in measures if m in WEIGHT_MEASURES}
    return AxiomTable(constructed, invariance)
