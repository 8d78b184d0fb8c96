"""The causal ground truth: the K-only path ablation of every pair, and how well each measure (and
the matching score) agrees with it (docs/measures.md, "Ground truth: ablation")."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from metrics.ground_truth.ablation import ABLATION_KINDS, KeyAblation
from metrics.ground_truth.attribution import METHODS, ablation_effects
from metrics.ground_truth.validity import Agreement, agreements
from metrics.heads.circuit_scores import MATCHING
from metrics.tracked.base import Every, Output, PerPair, ProbeRun, Scalar, TrackedQuantity


@dataclass
class AblationOptions(Every):
    """Every this many steps; ``method``: exact, attribution (first order), or auto (exact while it
    is cheap, :func:`~metrics.ground_truth.attribution.choose_method`); ``kind``: what replaces the
    writer's output (:data:`~metrics.ground_truth.ablation.ABLATION_KINDS`)."""

    method: str = "auto"
    kind: str = "per_position"

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.method not in METHODS:
            problems.append(f"method={self.method!r} must be one of {METHODS}")
        if self.kind not in ABLATION_KINDS:
            problems.append(f"kind={self.kind!r} must be one of {ABLATION_KINDS}")
        return problems


@dataclass(frozen=True)
class AblationResult:
    """The effects of every pair and the method that computed them (``exact`` or ``attribution``)."""

    effects: KeyAblation
    method: str


class Ablation(TrackedQuantity):
    """The K-only path ablation of every earlier->later pair (:mod:`metrics.ground_truth.ablation`):
    ``ablation/{loss_change,pattern_change}/...`` and the circuit pair's, ``circuit/ablation/...``.

    With training-time interventions in layer 0 only it is the model as it trains (the readers'
    layers are recomputed from this clean run); with one in a reader's layer it reads the weights
    without them (docs/measures.md, "Ground truth under interventions")."""

    name = "ablation"
    Options = AblationOptions
    reads_head_writes = True
    pair_keys = 2
    story = ("circuit/ablation/loss_change",)

    def applies(self, model) -> bool:
        return model.shape.n_layers > 1

    def measure(self, run: ProbeRun) -> AblationResult:
        model = run.model
        on_readers = any(layer.changes for layer in model.layers[1:])
        with model.changes_off() if on_readers else nullcontext():
            effects, method = ablation_effects(
                model,
                run.probe,
                self.options.method,
                None if on_readers else (run.logits, run.cache),
                max_chunk_bytes=run.max_chunk_bytes,
                kind=self.options.kind,
            )
        return AblationResult(effects, method)

    def outputs(self, result: AblationResult, run: ProbeRun) -> list[Output]:
        return [
            PerPair(f"ablation/{effect}", values, circuit=f"ablation/{effect}", top=f"top/ablation/{effect}")
            for effect, values in result.effects.effects().items()
        ]


HEAD_LEVEL_EFFECTS = ("loss_change",)
"""Ablation effects whose writer- and reader-level agreement is logged (the validity table reads
only these); 4 keys per scorer and effect, so the pattern effect's would cost 4(M + 1) more."""


class Validity(TrackedQuantity):
    """Each measure's K-composition (and the matching score) against the ablation, at every ablation:
    ``validity/{effect}/{measure}/{rank_of_truth,spearman}`` over pairs and, for the loss effect, over
    writers and readers (:mod:`metrics.ground_truth.validity`)."""

    name = "validity"
    after = ("ablation", "composition", "matching")
    runs_with = ("ablation",)

    def due(self, step: int, last: bool) -> bool:
        return False  # only with the ablation

    def measure(self, run: ProbeRun) -> dict[str, dict[str, Agreement]] | None:
        ablation, composition = run.results.get("ablation"), run.results.get("composition")
        if ablation is None or composition is None:
            return None
        scorers = {m: by_kind["K"] for m, by_kind in composition.scores.items()}
        if run.results.get("matching") is not None:
            scorers[MATCHING] = run.results["matching"]
        return {
            effect: agreements({name: scores.double() for name, scores in scorers.items()}, truth)
            for effect, truth in ablation.effects.effects().items()
        }

    def outputs(self, result: dict[str, dict[str, Agreement]] | None, run: ProbeRun) -> list[Output]:
        """Rank and Spearman per effect and measure; for the effects in ``HEAD_LEVEL_EFFECTS`` when the
        agreement carries them, the head levels ``.../{writer,reader}_{rank_of_truth,spearman}``; an
        undefined (NaN) Spearman is left out."""
        outputs: list[Output] = []
        for effect, by_measure in (result or {}).items():
            for measure, agreed in by_measure.items():
                levels = [("", agreed)]
                if effect in HEAD_LEVEL_EFFECTS:
                    levels += [(f"{level}_", getattr(agreed, level, None)) for level in ("writer", "reader")]
                for prefix, level in levels:
                    if level is None:
                        continue
                    outputs.append(
                        Scalar(f"validity/{effect}/{measure}/{prefix}rank_of_truth", float(level.rank_of_truth))
                    )
                    if level.spearman == level.spearman:  # undefined (NaN) when a side is constant
                        outputs.append(Scalar(f"validity/{effect}/{measure}/{prefix}spearman", level.spearman))
        return outputs
