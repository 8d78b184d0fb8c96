"""What the tracker's parts cost: a ledger of seconds per part, the report printed early in a run
(a snapshot's parts, their schedules and the expected overhead on training) and the totals at the end.

The estimate charges each part its last run's seconds over its own period; one-time costs (the
random baselines' first sampling, W&B's set-up at the first heatmap) are left out of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

WITH_ALL = "composition of every measure"
"""The ledger's name for the composition of a snapshot that scores every tracked measure, not only the dense ones."""


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
    """The cost ledger of one tracker and its reports. ``schedule`` is the tracker's
    :class:`~callbacks.tracker.Schedule`; ``measures`` all tracked, ``dense_measures`` those scored
    at every snapshot."""

    def __init__(self, schedule, measures: tuple[str, ...], dense_measures: tuple[str, ...]) -> None:
        self.schedule, self.measures, self.dense_measures = schedule, measures, dense_measures
        self.ledger = CostLedger()
        self._clock: tuple[int, float, float] | None = None  # (step, time, tracker seconds) when the clock started
        self._reported = False

    def report_once(self, step: int, ablation_used: str | None = None) -> str | None:
        """At the first snapshot, start the clock; at the second, the cost report (once; else None)."""
        now = time.perf_counter()
        spent = self.ledger.seconds.get("snapshot", 0.0) + self.ledger.seconds.get("images", 0.0)
        if self._clock is None:
            self._clock = (step, now, spent)
            return None
        if self._reported or step == self._clock[0]:
            return None
        first_step, first_time, first_spent = self._clock
        training = now - first_time - (spent - first_spent)  # wall time since, less the tracker's own
        step_seconds = max(training, 1e-9) / (step - first_step)
        self._reported = True
        return self.lines(step_seconds, ablation_used)

    def amortised_seconds_per_step(self, seconds: dict[str, float] | None = None) -> dict[str, float]:
        """Each part's cost per training step: its seconds per run (default: the last run's) over its
        period. Heatmaps drawn only once so far are left out: the first drawing pays W&B's one-time set-up."""
        s, last = self.schedule, self.ledger.last if seconds is None else seconds
        composition, others = self.composition_seconds(last)
        base = composition + sum(last.get(p, 0.0) for p in ("probe", "head scores", "logging"))
        per_step = {"snapshot": base / s.every_n_steps}
        if others:
            per_step["other measures"] = others / s.all_measures
        for part, every in (
            ("ablation", s.ablation),
            ("validity", s.ablation),
            ("copying", s.copying),
            ("matching", s.matching),
            ("images", s.images),
        ):
            if every and part in last and not (part == "images" and seconds is None and self.first_heatmaps_only):
                per_step[part] = last[part] / every
        return per_step

    @property
    def first_heatmaps_only(self) -> bool:
        """Whether the heatmaps have been drawn once only (their seconds include W&B's one-time set-up)."""
        return self.ledger.runs.get("images", 0) == 1

    def composition_seconds(self, last: dict[str, float]) -> tuple[float, float]:
        """Seconds of a snapshot's composition at every snapshot (the dense measures), and the extra
        seconds of every other measure where they run on their own schedule (0 where they run at
        every snapshot or none is tracked)."""
        dense, full = last.get("composition"), last.get(WITH_ALL)
        if full is None:
            return dense or 0.0, 0.0
        if dense is None or not self.schedule.all_measures:
            return full, 0.0
        return dense, max(full - dense, 0.0)

    def lines(self, step_seconds: float, ablation_used: str | None = None) -> str:
        """The cost report: a snapshot's parts and their schedules, and the expected overhead."""
        s, last = self.schedule, self.ledger.last
        ms = lambda part: f"{1000 * last[part]:.1f} ms" if part in last else "n/a"
        per_step = self.amortised_seconds_per_step()
        overhead = sum(per_step.values()) / step_seconds
        ablation = f"{ms('ablation')} ({ablation_used})" if ablation_used else ms("ablation")
        heatmaps = f"heatmaps {ms('images')} every {s.images or 'never'}"
        if self.first_heatmaps_only:
            heatmaps = f"heatmaps every {s.images} (the first took {ms('images')} with W&B's one-time set-up; not in the estimate)"
        composition, others = self.composition_seconds(last)
        scored = len(self.dense_measures) if others else len(self.measures)
        lines = [
            f"tracker cost: a snapshot every {s.every_n_steps} steps costs"
            f" {1000 * (last.get('probe', 0) + last.get('head scores', 0) + composition + last.get('logging', 0)):.1f} ms"
            f" (probe {ms('probe')}, composition {1000 * composition:.1f} ms for {scored} measure{'s' * (scored != 1)}, logging {ms('logging')});",
            *(
                [
                    f"  the {len(self.measures) - scored} other measures {1000 * others:.1f} ms more every {s.all_measures}"
                ]
                if others
                else []
            ),
            f"  ablation {ablation} every {s.ablation or 'never'}, matching {ms('matching')} every {s.matching or 'never'},"
            f" copying scores {ms('copying')} every {s.copying or 'never'}, {heatmaps}",
            f"  training {1000 * step_seconds:.1f} ms/step -> expected tracker overhead {overhead:.1%}"
            + ("" if overhead < 0.25 else " (high: raise tracker.every_n_steps or the expensive parts' every_n_steps)"),
        ]
        return "\n".join(lines)

    def totals_line(self) -> str:
        seconds, runs = self.ledger.seconds, self.ledger.runs
        images = f", heatmaps {seconds['images']:.1f} s ({runs['images']} times)" if "images" in seconds else ""
        return (
            f"tracker: {runs.get('snapshot', 0)} snapshots in {seconds.get('snapshot', 0):.1f} s"
            f" (composition {seconds.get('composition', 0) + seconds.get(WITH_ALL, 0):.1f} s, ablation {seconds.get('ablation', 0):.1f} s){images}"
        )
