"""A run's strategy timeline, from its CSV log and tensor store: the steps where the closest strategy
changes (each with its interval over resamples of the held-out sequences), the steps where each
strategy's mixture weight starts to rise, and the paper-style figure (each KL against step, the
strategies' own KL(truth ‖ strategy) as horizontal lines; Edelman et al. 2024, Fig. 2).

The switches are the run's stage truth: a transition is named by the strategies it connects
(``uniform → copy``, ``copy → induction``, ``unigram → bigram``), and the induction cliff's summary
keys (``phase_change/loss_*``, ``phase_change/induction_*``) are kept only in a run whose timeline
shows induction: a switch to it, or, in a run that ends before the model is closer to induction than
to anything else, induction's mixture weight rising (``phase_change/confirmed_by`` says so). That
holds where the task names its own strategies. A task that names none is compared with the generic
ones at every position (:meth:`data.task.Task.reference`), most of them unpredictable: a timeline of
those that shows no induction leaves the cliff's keys in place and says it did not check them
(``phase_change/unchecked``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metrics.dynamics.strategy_readings import (
    RISE_WEIGHT,
    Switch,
    closest,
    rise_steps,
    switches,
    switches_with_intervals,
)
from metrics.tracked.strategies import PER_SEQUENCE, PREFIX
from records.tensor_store import read_tensor_store

KL, WEIGHT, LINE = f"{PREFIX}kl/", f"{PREFIX}weight/", f"{PREFIX}line/"
CLIFF_STRATEGY = "induction"
"""The strategy a run's timeline must show (a switch to it, or its mixture weight rising) for its
largest loss fall to be reported as the induction cliff."""
CLIFF_KEYS = ("phase_change/loss_", "phase_change/induction_")
LEFT_OUT, UNCHECKED, CONFIRMED_BY = "phase_change/left_out", "phase_change/unchecked", "phase_change/confirmed_by"


@dataclass(frozen=True)
class Timeline:
    """``names``: the strategies; ``steps [n]``, ``kl [n, S]`` (KL(strategy ‖ model)), ``truth [n]`` or
    None, ``weights [n, S]``, ``lines``: KL(truth ‖ strategy) by name; the switches and rises."""

    names: list[str]
    steps: np.ndarray
    kl: np.ndarray
    truth: np.ndarray | None
    weights: np.ndarray
    lines: dict[str, float]
    switches: list[Switch]
    rises: dict[str, float]

    @property
    def cliff_switch(self) -> Switch | None:
        """The first switch to the induction strategy, if any."""
        return next((switch for switch in self.switches if switch.target == CLIFF_STRATEGY), None)

    @property
    def reaches_cliff(self) -> bool:
        """Whether the timeline shows induction: a switch to it, or its mixture weight rising (the model
        takes it up in part; :data:`metrics.dynamics.strategy_readings.RISE_WEIGHT`)."""
        return self.cliff_switch is not None or CLIFF_STRATEGY in self.rises

    def rise_without_switch(self) -> str | None:
        """What shows induction where no switch to it does (its weight's rise, its last weight, the
        closest strategy at the end); None where a switch does, or nothing."""
        if self.cliff_switch is not None or CLIFF_STRATEGY not in self.rises:
            return None
        last = self.names[int(closest(self.kl)[-1])]
        weight = float(self.weights[-1, self.names.index(CLIFF_STRATEGY)])
        return (
            f"{CLIFF_STRATEGY}'s mixture weight rises at step {self.rises[CLIFF_STRATEGY]:g}"
            f" ({RISE_WEIGHT} and held; {weight:.2f} at step {self.steps[-1]:g}); no switch to {CLIFF_STRATEGY}:"
            f" the closest strategy at the end is {last}"
        )


def strategy_names(series) -> list[str]:
    """The strategies a run tracked, from its ``strategies/weight/NAME`` columns."""
    return sorted(key.removeprefix(WEIGHT) for key in series if key.startswith(WEIGHT))


def read_timeline(series, store_dir: Path | None = None) -> Timeline | None:
    """The timeline of a run's series (:func:`reports.run_report.read_series`); switch intervals from
    the tensor store's per-sequence KLs when ``store_dir`` holds them. None: no strategies tracked."""
    names = strategy_names(series)
    if not names or any(KL + name not in series for name in names):
        return None
    steps = series[KL + names[0]][0]
    kl = np.stack([series[KL + name][1] for name in names], axis=1)
    weights = np.stack([series[WEIGHT + name][1] for name in names], axis=1)
    truth = series[KL + "truth"][1] if KL + "truth" in series else None
    lines = {name: float(series[LINE + name][1][-1]) for name in names if LINE + name in series}
    stored = {}
    if store_dir is not None and store_dir.is_dir():
        stored = read_tensor_store(store_dir, [PREFIX + PER_SEQUENCE + name for name in names])
    counts = {len(stored[PREFIX + PER_SEQUENCE + name][0]) for name in names} if len(stored) == len(names) else set()
    if len(counts) > 1:  # a file of the store cut short: its complete snapshots only, the others to as many
        print(
            f"{store_dir}: the strategies' per-sequence records hold {sorted(counts)} snapshots (a file cut short?);"
            f" read to the first {min(counts)}",
            file=sys.stderr,
        )
    if len(stored) == len(names):
        shortest = min(counts)
        per_sequence = np.stack([stored[PREFIX + PER_SEQUENCE + name][1][:shortest] for name in names], axis=1)
        found = switches_with_intervals(stored[PREFIX + PER_SEQUENCE + names[0]][0][:shortest], per_sequence, names)
    else:
        found = switches(steps, closest(kl), names)
    return Timeline(names, steps, kl, truth, weights, lines, found, rise_steps(steps, weights, names))


def timeline_summary(timeline: Timeline) -> dict[str, object]:
    """``strategies/switch/{i}`` (``"uniform → unigram"``), its ``/step``, ``/low``, ``/high`` and
    ``/found`` (share of resamples that have it), ``strategies/rise/NAME_step``,
    ``strategies/switches`` (how many), and for a task with a truth, ``strategies/stage/NAME/truth_kl``:
    the median KL(truth ‖ model) over the snapshots where NAME is the closest strategy (a stage's
    plateau, against the line KL(truth ‖ NAME))."""
    summary: dict[str, object] = {f"{PREFIX}switches": len(timeline.switches)}
    for i, switch in enumerate(timeline.switches, start=1):
        key = f"{PREFIX}switch/{i}"
        summary[key] = switch.label
        summary[f"{key}/step"] = switch.step
        if not np.isnan(switch.found):
            summary.update({f"{key}/low": switch.low, f"{key}/high": switch.high, f"{key}/found": switch.found})
    for name, step in timeline.rises.items():
        summary[f"{PREFIX}rise/{name}_step"] = step
    if timeline.truth is not None:
        nearest = closest(timeline.kl)
        for s, name in enumerate(timeline.names):
            if (nearest == s).any():
                summary[f"{PREFIX}stage/{name}/truth_kl"] = float(np.median(timeline.truth[nearest == s]))
    return summary


def without_false_cliff(
    summary: dict[str, object], timeline: Timeline | None, generic: bool = False
) -> dict[str, object]:
    """``summary`` without the induction cliff's keys when the run tracked its task's own strategies
    and its timeline shows no induction (its largest loss fall was another transition, named by the
    switches; ``phase_change/left_out`` says so). Kept on a rise of induction's weight alone, with
    ``phase_change/confirmed_by`` saying so. With ``generic`` strategies (a task that names none,
    :func:`data.task.names_own_strategies`) no induction found proves nothing: the keys stay and
    ``phase_change/unchecked`` says why they were not checked."""
    if timeline is None or not any(key.startswith(CLIFF_KEYS) for key in summary):
        return summary
    if timeline.reaches_cliff:
        rise = timeline.rise_without_switch()
        return summary if rise is None else {**summary, CONFIRMED_BY: rise}
    if generic:
        return {
            **summary,
            UNCHECKED: "the task names no strategies of its own: the generic ones, scored at every position,"
            " show no induction, which does not rule the cliff out",
        }
    kept = {key: value for key, value in summary.items() if not key.startswith(CLIFF_KEYS)}
    kept[LEFT_OUT] = "no switch to the induction strategy: see strategies/switch/*"
    return kept


def generic_strategies(task_name: str | None) -> bool:
    """Whether the task ``task_name`` (a run's ``data.name``) is scored on the generic strategies, naming
    none of its own; False for a name no registered task has (nothing known: the cliff is checked)."""
    from data.task import names_own_strategies, tasks

    task = tasks().get(task_name) if task_name else None
    return task is not None and not names_own_strategies(task)


def timeline_figure(timeline: Timeline, title: str):
    """Each strategy's KL(strategy ‖ model) and KL(truth ‖ model) against step (log scale), the lines
    KL(truth ‖ strategy), the switches marked; below, the mixture weights."""
    from reports.plots import plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[2, 1])
    colors = {name: f"C{i}" for i, name in enumerate(timeline.names)}
    for s, name in enumerate(timeline.names):
        top.plot(timeline.steps, timeline.kl[:, s], color=colors[name], label=f"KL({name} ‖ model)")
        if name in timeline.lines:
            top.axhline(timeline.lines[name], color=colors[name], ls=":", lw=1, label=f"KL(truth ‖ {name})")
        bottom.plot(timeline.steps, timeline.weights[:, s], color=colors[name], label=name)
    if timeline.truth is not None:
        top.plot(timeline.steps, timeline.truth, color="k", lw=1.5, label="KL(truth ‖ model)")
    for switch in timeline.switches:
        for ax in (top, bottom):
            if not np.isnan(switch.low):
                ax.axvspan(switch.low, switch.high, color="0.85", zorder=0)
            ax.axvline(switch.step, color="0.4", ls="--", lw=0.8)
        top.annotate(
            switch.label,
            (switch.step, 1),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            rotation=90,
            va="top",
            ha="right",
        )
    top.set_yscale("log")
    top.set_ylabel("KL (nats)")
    top.legend(fontsize=7, ncol=2)
    top.set_title(title, fontsize=9)
    bottom.set_ylabel("mixture weight")
    bottom.set_xlabel("step")
    bottom.set_ylim(-0.02, 1.02)
    bottom.legend(fontsize=7)
    fig.tight_layout()
    return fig
