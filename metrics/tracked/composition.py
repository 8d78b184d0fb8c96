"""Composition: every tracked measure (``tracker.measures``) of every earlier->later head pair, Q, K
and V, with each weight-based measure's random baseline; the data-aware share, a measure with
options of its own; and the heatmaps drawn from them.

The measures come from their registry (:data:`metrics.composition.measures.MEASURES`): a weight-based
one is a score of :class:`~metrics.composition.measures.PairStats` computed in its residual basis, all
of them batched through one engine (:func:`~metrics.composition.scores.composition_of`); a data-aware
one (:class:`~metrics.composition.measures.DataMeasure`) reads the probe pass itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from metrics.composition.baseline import BASELINE_SAMPLES, Baseline, random_baselines
from metrics.composition.data_shares import (
    CENTRES,
    DEFAULT_CENTRE,
    DEFAULT_ROWS,
    ROWS,
    SHARE,
    data_shares,
    induction_keys,
    row_weights,
)
from metrics.composition.measures import MEASURES, WEIGHT_MEASURES, DataMeasure, register_measure
from metrics.composition.scores import composition_of
from metrics.composition.whitening import Whitening
from metrics.tracked.base import Every, Heatmap, Output, PerPair, ProbeRun, Scalar, Stored, TrackedQuantity, as_numpy

KINDS_RANKED = "K"
"""The kind whose top pairs are named in summary mode: K-composition is what induction heads use."""

STORY_MEASURE = "frobenius"
"""The measure whose circuit-pair curve is told in W&B's ``1_story``: the one aslvrstn 2022 ("Composition
Measures in Transformers") plotted, and the one the tracker logs most often by default."""


# --- the data-aware share, a measure with options -------------------------------------------------------


@dataclass
class ShareOptions:
    """The data-aware share's options (:mod:`metrics.composition.data_shares`): which probe positions
    weigh (``ROWS``), what else the scores are centred over (``CENTRES``), and the floor (logit² a
    weighed pair adds to the Q/K shares' denominators; 0: the exact share, whose parts sum to 1)."""

    rows: str = DEFAULT_ROWS
    centre: str = DEFAULT_CENTRE
    floor: float = 0.0

    def problems(self) -> list[str]:
        problems = []
        if self.rows not in ROWS:
            problems.append(f"rows={self.rows!r} must be one of {ROWS}")
        if self.centre not in CENTRES:
            problems.append(f"centre={self.centre!r} must be one of {CENTRES}")
        if not (np.isfinite(self.floor) and self.floor >= 0):
            problems.append(f"floor={self.floor} must be a finite number >= 0")
        return problems


class DataShare(DataMeasure):
    """Each upstream part's share of what a reader reads on the probe (:func:`~metrics.composition.data_shares.data_shares`):
    the writer heads' shares are its scores; what the circuit's reader reads besides them (tokens,
    positions, biases) is logged as ``circuit/share/{Q,K,V}/{tokens,positions,biases}``."""

    name = SHARE
    Options = ShareOptions

    def scores(self, run: ProbeRun, options: ShareOptions):
        probe = run.probe
        weights = row_weights(probe, options.rows, run.tokens.device)
        keys = induction_keys(probe, run.tokens.device) if options.rows == "induction" else None
        parts = data_shares(run.model, run.tokens, run.cache, weights, options.centre, keys, options.floor).to("cpu")
        return parts.heads, parts

    def outputs(self, parts, run: ProbeRun) -> list[Output]:
        if run.circuit is None:
            return []
        layer, head = run.circuit[1]
        return [
            Scalar(f"circuit/share/{kind}/{part}", float(getattr(parts, part)[kind][layer, head]))
            for kind in parts.heads
            for part in ("tokens", "positions", "biases")
        ]


register_measure(DataShare())


# --- composition ----------------------------------------------------------------------------------


@dataclass
class CompositionOptions:
    """The tracker's own options (``tracker.measures``, ...): which measures it scores, at every
    snapshot (``dense_measures``) or every ``all_measures.every_n_steps`` (and at every ablation; 0: at
    every snapshot); the whitened bases recomputed every ``whitening.every_n_steps`` and reused in
    between (0: whenever scored); random pairs behind each baseline."""

    measures: list[str] = field(
        default_factory=lambda: [
            "frobenius",
            "sv_bound",
            "whitened",
            "whitened_resid",
            "token_space",
            "subspace",
            "component",
            "component_share",
            "share",
        ]
    )
    dense_measures: list[str] = field(default_factory=lambda: ["frobenius", "share"])
    all_measures: Every = field(default_factory=Every)
    whitening: Every = field(default_factory=Every)
    baseline_samples: int = BASELINE_SAMPLES

    def problems(self) -> list[str]:
        problems = []
        for key in ("measures", "dense_measures"):
            unknown = sorted(set(getattr(self, key)) - set(MEASURES))
            if unknown:
                problems.append(f"{key} has unknown {unknown}; known: {sorted(MEASURES)}")
        if not self.measures:
            problems.append("measures is empty: name at least one (e.g. [frobenius])")
        for key in ("all_measures", "whitening"):
            every = getattr(self, key).every_n_steps
            if every < 0:
                problems.append(f"{key}.every_n_steps={every} must be >= 0 (0 at every snapshot)")
        if self.baseline_samples < 2:
            problems.append(f"baseline_samples={self.baseline_samples} must be >= 2")
        return problems


@dataclass(frozen=True)
class CompositionScores:
    """``scores``: ``{measure: {kind: [L, H, L, H]}}`` on the CPU; ``baselines``: the weight-based
    measures' random baselines; ``extras``: what each data-aware measure keeps for its outputs."""

    scores: dict[str, dict[str, Tensor]]
    baselines: dict[str, Baseline]
    extras: dict[str, object] = field(default_factory=dict)
    dense: bool = False  # the measures scored are the dense ones (every tracked one only where all are dense)

    def minus_baseline(self, measure: str, kind: str) -> Tensor:
        return self.scores[measure][kind] - self.baselines[measure].mean

    def pair_rank(self, measure: str, kind: str, pair) -> int:
        """1 + the number of scored pairs with a higher score than ``pair`` (1 = top)."""
        scores = self.scores[measure][kind]
        (l1, h1), (l2, h2) = pair
        return 1 + int((scores.nan_to_num(float("-inf")) > scores[l1, h1, l2, h2]).sum())


class Composition(TrackedQuantity):
    """Q-, K- and V-composition under every tracked measure: ``comp/``, ``circuit/K/``, ``top/K/`` keys.

    Its options sit at the tracker's root (``tracker.measures``, ``tracker.all_measures.every_n_steps``, ...).
    Runs at every snapshot: the dense measures always, every measure at its own steps and with the
    ablation (which judges them all). Keeps the whitened bases between their refreshes."""

    name = "composition"
    Options = CompositionOptions
    after = ("circuit",)
    story = (f"circuit/K/{STORY_MEASURE}", f"circuit/K/{STORY_MEASURE}_minus_baseline_rank", f"circuit/K/{SHARE}")
    summary = (
        f"circuit/K/{STORY_MEASURE}",
        f"circuit/K/{STORY_MEASURE}_minus_baseline",
        f"circuit/K/{STORY_MEASURE}_minus_baseline_rank",
        f"circuit/K/{SHARE}",
    )

    root_options = True

    def __init__(self, options: CompositionOptions | None = None, measure_options: dict | None = None) -> None:
        super().__init__(options)
        self.measure_options = {name: m.Options() for name, m in MEASURES.items() if getattr(m, "Options", None)}
        self.measure_options.update(measure_options or {})
        self.whitenings: dict[str, Whitening] = {}

    @classmethod
    def from_options(cls, options: dict) -> Composition:
        """From every quantity's and measure's options by name (its own: ``options["composition"]``)."""
        return cls(options.get(cls.name), {m: options[m] for m in MEASURES if m in options})

    @property
    def pair_keys(self) -> int:
        """Per pair: Q, K, V raw and minus the baseline for a weight-based measure, raw only for a data-aware one."""
        return sum(6 if m in WEIGHT_MEASURES else 3 for m in self.options.measures)

    def dense(self) -> tuple[str, ...]:
        return tuple(m for m in self.options.measures if m in self.options.dense_measures)

    def every_measure_due(self, run: ProbeRun) -> bool:
        """Whether every tracked measure is scored at this snapshot (else the dense ones only)."""
        every = self.options.all_measures.every_n_steps
        return "ablation" in run.due or not every or run.step % every == 0 or run.last

    def for_rescoring(self) -> Composition:
        """Every measure at every chosen step, the whitened bases from that step."""
        never = Every(0)
        self.options = dataclasses.replace(self.options, all_measures=never, whitening=never)
        return self

    def measure(self, run: ProbeRun) -> CompositionScores:
        every = self.every_measure_due(run)
        measures = tuple(self.options.measures) if every else self.dense()
        refresh = self.options.whitening.every_n_steps
        if not refresh or run.step % refresh == 0 or run.last:
            self.whitenings = {}
        weighed = tuple(m for m in measures if m in WEIGHT_MEASURES)
        scores = (
            composition_of(
                run.model,
                weighed,
                run.circuits,
                residual=run.cache["resid_pre"],
                whitenings=self.whitenings,
                max_chunk_bytes=run.max_chunk_bytes,
            )
            if weighed
            else {}
        )
        extras = {}
        for m in measures:
            if isinstance(MEASURES[m], DataMeasure):
                scores[m], extras[m] = MEASURES[m].scores(run, self.measure_options.get(m))
        scores = {m: {kind: s.cpu() for kind, s in scores[m].items()} for m in measures if m in scores}
        shape = run.model.shape
        baselines = {
            m: b
            for m, b in random_baselines(shape.d_model, shape.d_head, self.options.baseline_samples).items()
            if m in measures
        }
        return CompositionScores(scores, baselines, extras, dense=measures == self.dense())

    def outputs(self, result: CompositionScores, run: ProbeRun) -> list[Output]:
        outputs: list[Output] = []
        for measure, by_kind in result.scores.items():
            baseline = result.baselines.get(measure)
            if baseline is not None:
                outputs += [
                    Scalar(f"comp/baseline/{measure}", baseline.mean),
                    Scalar(f"comp/baseline/{measure}_stderr", baseline.stderr),
                    Stored(f"comp/baseline/{measure}", np.array([baseline.mean, baseline.stderr])),
                ]
            raw = {kind: as_numpy(scores) for kind, scores in by_kind.items()}
            for kind, scores in raw.items():
                top = f"top/{kind}/{measure}" if kind == KINDS_RANKED else None
                outputs.append(PerPair(f"comp/{kind}/{measure}", scores, top=top))
                if baseline is not None:
                    outputs.append(
                        PerPair(f"comp/{kind}/{measure}_minus_baseline", scores - baseline.mean, store=False)
                    )
            if run.circuit is not None and "K" in raw:
                (l1, h1), (l2, h2) = run.circuit
                circuit_k = raw["K"][l1, h1, l2, h2]  # a numpy scalar: minus the baseline in the tensor's precision
                outputs.append(Scalar(f"circuit/K/{measure}", float(circuit_k)))
                if baseline is not None:
                    outputs.append(Scalar(f"circuit/K/{measure}_minus_baseline", float(circuit_k - baseline.mean)))
                    rank = result.pair_rank(measure, "K", run.circuit)
                    outputs.append(Scalar(f"circuit/K/{measure}_minus_baseline_rank", float(rank)))
            if measure in result.extras:
                outputs += MEASURES[measure].outputs(result.extras[measure], run)
        return outputs

    def state_dict(self) -> dict:
        """The whitened bases in use since their last refresh (``{basis: {"half", "inverse_half"}}``,
        ``[d_model, d_model]`` each)."""
        return {"whitenings": {b: {"half": w.half, "inverse_half": w.inverse_half} for b, w in self.whitenings.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.whitenings = {basis: Whitening(**w) for basis, w in state.get("whitenings", {}).items()}


@dataclass
class HeatmapOptions(Every):
    every_n_steps: int = 200


class Heatmaps(TrackedQuantity):
    """Every scored measure's composition of every pair minus its baseline, as an image in W&B
    (``images/composition/MEASURE``: rows writers, columns readers, Q | K | V); drawn by the tracker."""

    name, label = "images", "heatmaps"
    Options = HeatmapOptions
    after = ("composition", "circuit")
    rescored_every_step = False

    def applies(self, model) -> bool:
        return model.shape.n_layers > 1

    def measure(self, run: ProbeRun) -> CompositionScores | None:
        return run.results.get("composition")

    def outputs(self, result: CompositionScores | None, run: ProbeRun) -> list[Output]:
        heatmaps: list[Output] = []
        for measure, by_kind in (result.scores if result is not None else {}).items():
            baseline = result.baselines.get(measure)  # none for a data-aware measure
            scores = {kind: (s - baseline.mean if baseline else s).float().numpy() for kind, s in by_kind.items()}
            what = f"{measure} minus baseline" if baseline else measure
            caption = f"{what}, step {run.step}: rows writers, columns readers (Q | K | V)"
            heatmaps.append(Heatmap(f"composition/{measure}", scores, caption))
        return heatmaps
