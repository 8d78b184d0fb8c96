"""What the tracker's parts cost: a ledger of seconds per part, the report printed early in a run
(a snapshot's parts, each tracked quantity's schedule and the expected overhead on training) and the
totals at the end.

The estimate charges each part its last run's seconds over its own period: a quantity that runs at
every snapshot over the snapshot's, a scheduled one over its ``every_n_steps`` (one that runs with
another, over that one's). One-time costs (the random baselines' first sampling, W&B's set-up at the
first heatmap) are left out of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

WITH_ALL = "composition of every measure"
"""The ledger's name for the composition of a snapshot that scores every tracked measure, not only the dense ones."""
SNAPSHOT_PARTS = ("probe", "logging")
"""Parts of every snapshot that are no tracked quantity: the probe pass and the writing of its keys."""
HEATMAPS = "images"


@dataclass
class CostLedger:
    """Seconds spent per part, and how often each ran, for the cost report."""

    seconds: dict[str, float] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)  # the most recent run's seconds, per part

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds
        self.runs[part] = self.runs.get(part, 0) + 1
        self.last[part] = seconds


class TrackerCost:
    """The cost ledger of one tracker and its reports: ``quantities`` are the tracker's, in their
    order; ``every_n_steps`` its snapshot period."""

    def __init__(self, quantities, every_n_steps: int) -> None:
        self.quantities, self.every_n_steps = list(quantities), every_n_steps
        self.ledger = CostLedger()
        self._clock: tuple[int, float, float] | None = None  # (step, time, tracker seconds) when the clock started
        self._spent_at_start = 0.0  # the tracker's seconds in the ledger when the clock started
        self._reported = False

    def period(self, quantity) -> int | None:
        """Steps between a quantity's runs: its own, else that of one it runs with, else the
        snapshot's (None: it runs at every snapshot); 0: never."""
        if quantity.every_n_steps is not None:
            return quantity.every_n_steps
        for other in self.quantities:
            if other.name in quantity.runs_with and other.every_n_steps is not None:
                return other.every_n_steps
        return None

    @property
    def composition(self):
        return next((q for q in self.quantities if q.name == "composition"), None)

    @property
    def all_measures_every(self) -> int:
        """Steps between the snapshots that score every measure (0: every snapshot)."""
        composition = self.composition
        return composition.options.all_measures.every_n_steps if composition is not None else 0

    def report_once(
        self, step: int, ablation_used: str | None = None, training_clock: float | None = None
    ) -> str | None:
        """At the first snapshot, start the clock; at the second, the cost report (once; else None).
        ``training_clock``: seconds of training so far, where the caller knows them (an ensemble member:
        its share of the ensemble's steps, every member's callbacks left out); else the wall time since
        the first snapshot, less the tracker's own, is the training."""
        if self._clock is None:
            self._clock = (step, *self.clock(training_clock))
            self._spent_at_start = self.tracker_seconds()
            return None
        if self._reported or step == self._clock[0]:
            return None
        step_seconds = max(self.training_seconds(training_clock), 1e-9) / (step - self._clock[0])
        self._reported = True
        return self.lines(step_seconds, ablation_used)

    def tracker_seconds(self) -> float:
        """The tracker's own seconds so far: its snapshots and heatmaps."""
        return self.ledger.seconds.get("snapshot", 0.0) + self.ledger.seconds.get(HEATMAPS, 0.0)

    def clock(self, training_clock: float | None) -> tuple[float, float]:
        """``(now, tracker seconds on that clock)``: the wall clock, which the tracker's own time is on;
        or ``training_clock``, on which nothing of the tracker's is."""
        if training_clock is None:
            return time.perf_counter(), self.tracker_seconds()
        return training_clock, 0.0

    def training_seconds(self, training_clock: float | None = None) -> float:
        """Training seconds since the clock started (at the first snapshot): the time since, less the tracker's own."""
        now, spent = self.clock(training_clock)
        _, first_time, first_spent = self._clock
        return now - first_time - (spent - first_spent)

    def measured_share(self, training_clock: float | None = None) -> float | None:
        """What the tracker cost the run since its first snapshot: its seconds over the training seconds in
        that time (None before the first snapshot, or without training time). The early report estimates
        this from one interval; this is the run's own."""
        if self._clock is None:
            return None
        training = self.training_seconds(training_clock)
        return (self.tracker_seconds() - self._spent_at_start) / training if training > 0 else None

    def snapshot_parts(self) -> tuple[str, ...]:
        """The parts of every snapshot: the probe pass, the quantities that run at each, the logging."""
        every = tuple(q.name for q in self.quantities if self.period(q) is None and q.name != "composition")
        return (*SNAPSHOT_PARTS, *every)

    def amortised_seconds_per_step(self, seconds: dict[str, float] | None = None) -> dict[str, float]:
        """Each part's cost per training step: its seconds per run (default: the last run's) over its
        period. Heatmaps drawn only once so far are left out: the first drawing pays W&B's one-time set-up."""
        last = self.ledger.last if seconds is None else seconds
        composition, others = self.composition_seconds(last)
        base = composition + sum(last.get(part, 0.0) for part in self.snapshot_parts())
        per_step = {"snapshot": base / self.every_n_steps}
        if others:
            per_step["other measures"] = others / self.all_measures_every
        for quantity in self.quantities:
            every = self.period(quantity)
            first_only = quantity.name == HEATMAPS and seconds is None and self.first_heatmaps_only
            if every and quantity.name in last and not first_only:
                per_step[quantity.name] = last[quantity.name] / every
        return per_step

    @property
    def first_heatmaps_only(self) -> bool:
        """Whether the heatmaps have been drawn once only (their seconds include W&B's one-time set-up)."""
        return self.ledger.runs.get(HEATMAPS, 0) == 1

    def composition_seconds(self, last: dict[str, float]) -> tuple[float, float]:
        """Seconds of a snapshot's composition at every snapshot (the dense measures), and the extra
        seconds of every other measure where they run on their own schedule (0 where they run at
        every snapshot or none is tracked)."""
        dense, full = last.get("composition"), last.get(WITH_ALL)
        if full is None:
            return dense or 0.0, 0.0
        if dense is None or not self.all_measures_every:
            return full, 0.0
        return dense, max(full - dense, 0.0)

    def lines(self, step_seconds: float, ablation_used: str | None = None) -> str:
        """The cost report: a snapshot's parts, each scheduled quantity's cost and period, and the expected overhead."""
        last = self.ledger.last
        ms = lambda part: f"{1000 * last[part]:.1f} ms" if part in last else "n/a"
        per_step = self.amortised_seconds_per_step()
        overhead = sum(per_step.values()) / step_seconds
        composition, others = self.composition_seconds(last)
        measures = list(self.composition.options.measures) if self.composition is not None else []
        dense = [m for m in measures if m in self.composition.options.dense_measures] if measures else []
        scored = len(dense) if others else len(measures)
        snapshot = composition + sum(last.get(part, 0.0) for part in self.snapshot_parts())
        lines = [
            f"tracker cost: a snapshot every {self.every_n_steps} steps costs {1000 * snapshot:.1f} ms"
            f" (probe {ms('probe')}, composition {1000 * composition:.1f} ms for {scored} measure{'s' * (scored != 1)},"
            f" logging {ms('logging')});"
        ]
        if others:
            lines.append(
                f"  the {len(measures) - scored} other measures {1000 * others:.1f} ms more every {self.all_measures_every}"
            )
        scheduled = []
        for quantity in self.quantities:
            every = self.period(quantity)
            if every is None:
                continue
            label = getattr(quantity, "label", "") or quantity.name.replace("_", " ")
            cost = (
                f"{ms(quantity.name)} ({ablation_used})"
                if quantity.name == "ablation" and ablation_used
                else ms(quantity.name)
            )
            if quantity.name == HEATMAPS and self.first_heatmaps_only:
                scheduled.append(
                    f"{label} every {every} (the first took {ms(HEATMAPS)} with W&B's one-time set-up; not in the estimate)"
                )
            else:
                scheduled.append(f"{label} {cost} every {every or 'never'}")
        if scheduled:
            lines.append("  " + ", ".join(scheduled))
        lines.append(
            f"  training {1000 * step_seconds:.1f} ms/step -> expected tracker overhead {overhead:.1%}"
            + ("" if overhead < 0.25 else " (high: raise tracker.every_n_steps or the expensive parts' every_n_steps)")
        )
        return "\n".join(lines)

    def totals_line(self, training_clock: float | None = None) -> str:
        """The run's totals: snapshots and their seconds, and what they cost the training since the first
        (:meth:`measured_share`; ``training_clock`` as in :meth:`report_once`)."""
        seconds, runs = self.ledger.seconds, self.ledger.runs
        images = f", heatmaps {seconds[HEATMAPS]:.1f} s ({runs[HEATMAPS]} times)" if HEATMAPS in seconds else ""
        share = self.measured_share(training_clock)
        paid = f"; {share:.1%} of the training time since the first" if share is not None else ""
        return (
            f"tracker: {runs.get('snapshot', 0)} snapshots in {seconds.get('snapshot', 0):.1f} s"
            f" (composition {seconds.get('composition', 0) + seconds.get(WITH_ALL, 0):.1f} s, ablation {seconds.get('ablation', 0):.1f} s){images}"
            + paid
        )
