"""Everything the tracker measures at one step, from the model's weights and the probe batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from data.probe import ProbeBatch
from metrics.ground_truth.ablation import KeyAblation, key_ablation_effects
from metrics.composition.baseline import Baseline, random_baseline
from metrics.heads.circuit_pair import circuit_pair
from metrics.heads.circuit_scores import copying_scores, folded_unembedding, matching_scores
from metrics.composition.circuits import HeadCircuits, head_circuits
from metrics.composition.measures import PairMeasure, composition_scores, frobenius_ratio, pair_stacks
from metrics.heads.empirical_copying import empirical_copying
from metrics.heads.attention_scores import duplicate_token_score, induction_score, previous_token_score
from metrics.composition.spectral import best_component_ratio, best_component_share, singular_value_bound_ratio, subspace_overlap
from metrics.dynamics.loss_views import first_occurrence_loss, in_context_learning_score, repeated_loss, token_losses
from metrics.ground_truth.validity import Agreement, agreement
from metrics.composition.whitening import embedding_covariance, residual_covariance, whiten
from models.transformer import AttentionOnlyTransformer

COMPOSITION_MEASURES: dict[str, PairMeasure] = {
    "frobenius": frobenius_ratio,
    "sv_bound": singular_value_bound_ratio,
    "whitened": frobenius_ratio,  # computed on the whitened circuits, see WHITENED_MEASURES
    "whitened_resid": frobenius_ratio,  # likewise, whitened by the residual stream seen on the probe
    "subspace": subspace_overlap,
    "component": best_component_ratio,
    "component_share": best_component_share,
}
"""The composition measures the tracker can compute, by name (MEASURES.md's order): one line per measure."""

MATCHING = "match"
"""The QK matching score, judged against the ablation beside the composition measures."""

WHITENED_MEASURES = {"whitened": "embedding", "whitened_resid": "residual"}
"""Measures scored in a whitened residual basis (:mod:`metrics.composition.whitening`), by the covariance that
whitens: of the embeddings, or of the residual stream observed on the probe batch. Their random
baseline is that of the same pair measure on i.i.d. Gaussian weights, which are isotropic already."""

Head = tuple[int, int]  # (layer, head)


@dataclass(frozen=True)
class Snapshot:
    """One measurement. Composition tensors are ``[n_layers, n_heads, n_layers, n_heads]``
    (writer layer, writer head, reader layer, reader head; NaN where the reader is not later);
    head scores are ``[n_layers, n_heads]``."""

    composition: dict[str, dict[str, Tensor]]  # measure -> kind (Q, K, V) -> scores
    baselines: dict[str, Baseline]  # measure -> random baseline for the model's shapes
    previous_token: Tensor
    induction: Tensor
    duplicate_token: Tensor
    copying: Tensor  # weight copying score per head (Elhage et al. 2021)
    empirical_copying: Tensor  # copying score on the probe batch per head (Olsson et al. 2022), 2 s - 1
    copying_top_rate: Tensor  # how often a head raises the token it attends to most (seed 004)
    matching: Tensor  # QK matching score per pair (Olsson et al. 2022), [L, H, L, H]
    first_occurrence_loss: float
    repeated_loss: float
    icl_score: float
    circuit: tuple[Head, Head] | None  # (previous-token writer, induction reader); None for 1 layer
    ablation: KeyAblation | None = None  # K-only path ablation per pair, when asked for
    validity: dict[str, dict[str, Agreement]] | None = None  # effect -> measure (K) or "match" -> agreement

    def minus_baseline(self, measure: str, kind: str) -> Tensor:
        return self.composition[measure][kind] - self.baselines[measure].mean

    def pair_rank(self, measure: str, kind: str, pair: tuple[Head, Head]) -> int:
        """1 + the number of scored pairs with a higher score than ``pair`` (1 = top)."""
        scores = self.composition[measure][kind]
        (l1, h1), (l2, h2) = pair
        return 1 + int((scores.nan_to_num(float("-inf")) > scores[l1, h1, l2, h2]).sum())


def composition_of(
    model: AttentionOnlyTransformer,
    measures: tuple[str, ...],
    circuits: HeadCircuits | None = None,
    residual: list[Tensor] | None = None,
) -> dict[str, dict[str, Tensor]]:
    """``{measure: {kind: [n_layers, n_heads, n_layers, n_heads]}}`` for the named measures (NaN where
    the reader is not later). ``circuits``: ``head_circuits(model)`` if the caller has it already;
    ``residual``: each layer's input ``[batch, pos, d_model]`` on the probe, needed by ``whitened_resid``."""
    circuits = head_circuits(model) if circuits is None else circuits
    bases = {None: circuits}
    for m in measures:
        if WHITENED_MEASURES.get(m) == "embedding":
            bases[m] = whiten(circuits, embedding_covariance(model))
        elif WHITENED_MEASURES.get(m) == "residual":
            if residual is None:
                raise ValueError(f"{m} needs the residual stream observed on a probe batch")
            bases[m] = whiten(circuits, residual_covariance(residual))
    basis_of = lambda m: m if m in WHITENED_MEASURES else None
    stacks = {key: pair_stacks(basis) for key, basis in bases.items()}  # indexed once, scored by every measure
    return {m: composition_scores(bases[basis_of(m)], COMPOSITION_MEASURES[m], stacks=stacks[basis_of(m)]) for m in measures}


@torch.inference_mode()
def take_snapshot(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    measures: tuple[str, ...] = ("frobenius",),
    baseline_samples: int = 2000,
    ablate: bool = False,
) -> Snapshot:
    """Measure ``model`` on ``probe``; leaves the model's mode and every RNG untouched.

    ``ablate``: also run the K-only path ablation of every pair (a forward pass per pair) and judge
    each measure's K-composition, and the matching score, against it.
    """
    unknown = set(measures) - set(COMPOSITION_MEASURES)
    if unknown:
        raise ValueError(f"unknown composition measures {sorted(unknown)}; known: {sorted(COMPOSITION_MEASURES)}")
    was_training = model.training
    model.eval()
    try:
        tokens = probe.tokens.to(model.W_E.device)
        logits, cache = model.run_with_cache(tokens)
        ablation = key_ablation_effects(model, probe, (logits, cache)) if ablate and model.shape.n_layers > 1 else None
    finally:
        model.train(was_training)
    patterns = torch.stack(cache["pattern"])  # (L, b, h, t, t)
    previous = previous_token_score(patterns).cpu()  # (L, H)
    induction = induction_score(patterns, probe.repeat_start, probe.n).cpu()
    losses = token_losses(logits.float(), tokens)

    circuits = head_circuits(model)
    shape = model.shape
    composition = composition_of(model, measures, circuits, residual=cache["resid_pre"])
    baselines = {
        m: random_baseline(COMPOSITION_MEASURES[m], shape.d_model, shape.d_head, baseline_samples) for m in measures
    }
    matching = matching_scores(model, circuits).cpu()
    copying = empirical_copying(torch.stack(cache["head_out"]), patterns, tokens, folded_unembedding(model), probe.first_start)
    validity = None
    if ablation is not None:
        scorers = {**{m: composition[m]["K"] for m in measures}, MATCHING: matching}
        validity = {
            effect: {name: agreement(scores, truth) for name, scores in scorers.items()}
            for effect, truth in ablation.effects().items()
        }
    return Snapshot(
        composition=composition,
        baselines=baselines,
        previous_token=previous,
        induction=induction,
        duplicate_token=duplicate_token_score(patterns, probe.repeat_start, probe.n).cpu(),
        copying=copying_scores(model, circuits).cpu(),
        empirical_copying=copying.score.double().cpu(),
        copying_top_rate=copying.top_rate.double().cpu(),
        matching=matching,
        first_occurrence_loss=first_occurrence_loss(losses, probe.first_start, probe.n).item(),
        repeated_loss=repeated_loss(losses, probe.repeat_start, probe.n).item(),
        icl_score=in_context_learning_score(losses).item(),
        circuit=circuit_pair(previous, induction) if shape.n_layers >= 2 else None,
        ablation=ablation,
        validity=validity,
    )
