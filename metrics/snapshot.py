"""Everything the tracker measures at one step, from the model's weights and the probe batch.

Computed where the model lives (its device), in its dtype (at least float32: half-precision weights
are measured on a float32 copy) unless ``dtype`` asks for float64, the exact path the tests use. Only the small results (per head, per pair) are moved
to the CPU. Each part is timed, so a caller can say what a snapshot costs.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from data.probe import ProbeBatch
from metrics.composition.baseline import BASELINE_SAMPLES, Baseline, random_baselines
from metrics.composition.circuits import head_circuits
from metrics.composition.data_shares import (
    DATA_MEASURES,
    DEFAULT_CENTRE,
    DEFAULT_ROWS,
    SHARE,
    DataShares,
    data_shares,
    induction_keys,
    row_weights,
)
from metrics.composition.engine import DEFAULT_CHUNK_BYTES
from metrics.composition.measures import COMPOSITION_MEASURES
from metrics.composition.scores import composition_of
from metrics.composition.whitening import Whitening
from metrics.dynamics.loss_views import first_occurrence_loss, in_context_learning_score, repeated_loss, token_losses
from metrics.ground_truth.ablation import KeyAblation
from metrics.ground_truth.attribution import ablation_effects
from metrics.ground_truth.validity import Agreement, agreements
from metrics.heads.attention_scores import duplicate_token_score, induction_score, previous_token_score
from metrics.heads.circuit_pair import circuit_pair
from metrics.heads.circuit_scores import MATCHING, copying_scores, folded_unembedding, matching_scores
from metrics.heads.empirical_copying import empirical_copying
from models.transformer import AttentionOnlyTransformer

__all__ = ["COMPOSITION_MEASURES", "MATCHING", "MEASURES", "Snapshot", "composition_of", "take_snapshot"]

MEASURES = (*COMPOSITION_MEASURES, *DATA_MEASURES)
"""Every measure the tracker can score: the weight-based ones (:data:`COMPOSITION_MEASURES`, each
with a random baseline) and the data-aware share of the probe pass (:mod:`metrics.composition.data_shares`)."""

Head = tuple[int, int]  # (layer, head)
HALF_PRECISION = (torch.float16, torch.bfloat16)
"""Weights in these dtypes are measured on a float32 copy: a bf16 probe pass moves the scores by
~1 % (the ablation's pattern change by 1.5 % at init), which no measure should inherit."""


@dataclass(frozen=True)
class Snapshot:
    """One measurement. Composition tensors are ``[n_layers, n_heads, n_layers, n_heads]``
    (writer layer, writer head, reader layer, reader head; NaN where the reader is not later);
    head scores are ``[n_layers, n_heads]``. Parts not computed at this step are None."""

    composition: dict[str, dict[str, Tensor]]  # measure -> kind (Q, K, V) -> scores
    baselines: dict[str, Baseline]  # measure -> random baseline for the model's shapes
    previous_token: Tensor
    induction: Tensor
    duplicate_token: Tensor
    copying: Tensor | None  # weight copying score per head (Elhage et al. 2021)
    # Olsson et al. 2022's copying evaluator on the probe batch per head, 2 r - 1 (r: share of the raise over the sequence's tokens)
    empirical_copying: Tensor | None
    # how often a head raises the token it attends to most (notes on Elhage et al. 2021)
    copying_top_rate: Tensor | None
    matching: Tensor | None  # QK matching score per pair (Olsson et al. 2022), [L, H, L, H]
    first_occurrence_loss: float
    repeated_loss: float
    icl_score: float
    circuit: tuple[Head, Head] | None  # (previous-token writer, induction reader); None for 1 layer
    ablation: KeyAblation | None = None  # K-only path ablation per pair, when asked for
    ablation_method: str | None = None  # "exact" or "attribution" (first order), when ablated
    validity: dict[str, dict[str, Agreement]] | None = None  # effect -> measure (K) or "match" -> agreement
    share_parts: DataShares | None = None  # the data-aware shares of every part, when "share" was scored
    whitenings: dict[str, Whitening] = field(default_factory=dict)  # the whitened bases used (a tracker may reuse them)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each part

    def minus_baseline(self, measure: str, kind: str) -> Tensor:
        return self.composition[measure][kind] - self.baselines[measure].mean

    def pair_rank(self, measure: str, kind: str, pair: tuple[Head, Head]) -> int:
        """1 + the number of scored pairs with a higher score than ``pair`` (1 = top)."""
        scores = self.composition[measure][kind]
        (l1, h1), (l2, h2) = pair
        return 1 + int((scores.nan_to_num(float("-inf")) > scores[l1, h1, l2, h2]).sum())


class PartTimer:
    """Wall seconds per named part; synchronises CUDA so a part's asynchronous kernels count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@torch.inference_mode()
def take_snapshot(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    measures: tuple[str, ...] = ("frobenius",),
    baseline_samples: int = BASELINE_SAMPLES,
    ablate: bool = False,
    *,
    ablation_method: str = "exact",
    ablation_kind: str = "per_position",
    copying: bool = True,
    matching: bool = True,
    whitenings: dict[str, Whitening] | None = None,
    dtype: torch.dtype | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    share: tuple[str, str, float] = (DEFAULT_ROWS, DEFAULT_CENTRE, 0.0),
) -> Snapshot:
    """Measure ``model`` on ``probe``; leaves the model's mode and every RNG untouched.

    ``ablate``: also run the K-only path ablation of every pair (``ablation_method``: exact,
    attribution, or auto: exact while cheap; ``ablation_kind``: what replaces the writer's output,
    per_position, pooled or resample) and judge each measure's K-composition, and the
    matching score, against it. ``copying``, ``matching``: compute the copying scores (of the
    OV circuits' eigenvalues and Olsson's empirical evaluator on the probe) and the matching scores
    (each can be skipped on cheap steps).
    ``whitenings``: reuse these whitened bases (by basis: ``embedding``, ``residual``) instead of
    computing them from this step's weights and probe pass. ``share``: the data-aware share's rows,
    centring and floor (:data:`~metrics.composition.data_shares.ROWS`, ``CENTRES``; logit²).
    """
    unknown = set(measures) - set(MEASURES)
    if unknown:
        raise ValueError(f"unknown composition measures {sorted(unknown)}; known: {sorted(MEASURES)}")
    shares = SHARE in measures
    if model.W_E.dtype in HALF_PRECISION:  # trained in half precision: measured on a float32 copy
        model = copy.deepcopy(model).float()
    timer = PartTimer(model.W_E.device)
    shape = model.shape
    was_training = model.training
    model.eval()
    try:
        tokens = probe.tokens.to(model.W_E.device)
        with timer.part("probe"):
            # the heads' writes only for the parts that read them
            logits, cache = model.run_with_cache(tokens, head_out=copying or ablate)
        ablation = method = None
        if ablate and shape.n_layers > 1:
            # with training-time interventions in layer 0 only, the ablation is exact on the model as it
            # trains (it recomputes only the readers' layers, from this clean run); with one in a reader's
            # layer it reads the weights without them (docs/measures.md, "Ground truth under interventions")
            on_readers = any(layer.changes for layer in model.layers[1:])
            if model.intervened and not on_readers:
                ablation_method = "exact"  # attribution patching differentiates its own, unchanged, forward pass
            with timer.part("ablation"), model.changes_off() if on_readers else nullcontext():
                ablation, method = ablation_effects(
                    model,
                    probe,
                    ablation_method,
                    None if on_readers else (logits, cache),
                    max_chunk_bytes=max_chunk_bytes,
                    kind=ablation_kind,
                )
    finally:
        model.train(was_training)
    with timer.part("head scores"):
        patterns = torch.stack(cache["pattern"])  # (L, b, h, t, t)
        previous = previous_token_score(patterns).cpu()  # (L, H)
        induction = induction_score(patterns, probe).cpu()
        duplicate = duplicate_token_score(patterns, probe).cpu()
        losses = token_losses(logits.float(), tokens)
    with timer.part("composition"):
        whitenings = dict(whitenings or {})
        weighed = tuple(m for m in measures if m in COMPOSITION_MEASURES)
        # the weights' circuits: what the weight measures, the matching and the copying scores read (the share does not)
        circuits = head_circuits(model, dtype) if weighed or matching or copying else None
        composition = (
            composition_of(
                model,
                weighed,
                circuits,
                residual=cache["resid_pre"],
                whitenings=whitenings,
                max_chunk_bytes=max_chunk_bytes,
            )
            if weighed
            else {}
        )
        share_parts = None
        if shares:
            rows, centre, floor = share
            weights = row_weights(probe, rows, tokens.device)
            keys = induction_keys(probe, tokens.device) if rows == "induction" else None
            share_parts = data_shares(model, tokens, cache, weights, centre, keys, floor).to("cpu")
            composition[SHARE] = share_parts.heads
        composition = {
            m: {kind: scores.cpu() for kind, scores in composition[m].items()} for m in measures if m in composition
        }
        baselines = {
            m: b for m, b in random_baselines(shape.d_model, shape.d_head, baseline_samples).items() if m in measures
        }
    matching_scores_ = None
    if matching and shape.n_layers > 1:
        with timer.part("matching"):
            matching_scores_ = matching_scores(model, circuits).cpu()
    weight_copying = empirical = None
    if copying:
        with timer.part("copying"):
            weight_copying = copying_scores(model, circuits).cpu()
            empirical = empirical_copying(
                torch.stack(cache["head_out"]), patterns, tokens, folded_unembedding(model), probe.first_start
            )
    validity = None
    if ablation is not None:
        with timer.part("validity"):
            scorers = {m: composition[m]["K"] for m in measures}
            if matching_scores_ is not None:
                scorers[MATCHING] = matching_scores_
            validity = {
                effect: agreements({name: scores.double() for name, scores in scorers.items()}, truth)
                for effect, truth in ablation.effects().items()
            }
    return Snapshot(
        composition=composition,
        baselines=baselines,
        previous_token=previous,
        induction=induction,
        duplicate_token=duplicate,
        copying=weight_copying,
        empirical_copying=None if empirical is None else empirical.score.cpu().double(),
        copying_top_rate=None if empirical is None else empirical.top_rate.cpu().double(),
        matching=matching_scores_,
        first_occurrence_loss=first_occurrence_loss(losses, probe).item(),
        repeated_loss=repeated_loss(losses, probe).item(),
        icl_score=in_context_learning_score(losses).item(),
        circuit=circuit_pair(previous, induction) if shape.n_layers >= 2 else None,
        ablation=ablation,
        ablation_method=method,
        validity=validity,
        share_parts=share_parts,
        whitenings=whitenings,
        seconds=timer.seconds,
    )


@torch.inference_mode()
def without_interventions(model: AttentionOnlyTransformer, probe: ProbeBatch) -> dict[str, float]:
    """The repeated-token loss and the top previous-token and induction scores of ``model`` with its
    training-time interventions off (does the model still need them?), on ``probe``."""
    was_training = model.training
    model.eval()
    try:
        with model.changes_off():
            tokens = probe.tokens.to(model.W_E.device)
            logits, cache = model.run_with_cache(tokens, head_out=False)
    finally:
        model.train(was_training)
    patterns = torch.stack(cache["pattern"])  # (L, b, h, t, t)
    losses = token_losses(logits.float(), tokens)
    return {
        "loss/repeated": repeated_loss(losses, probe).item(),
        "heads/prev_token/top": previous_token_score(patterns).max().item(),
        "heads/induction/top": induction_score(patterns, probe).max().item(),
    }
