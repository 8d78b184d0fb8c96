"""The strategy timeline as the reports read it: from a run's series, the switches and rises named in
its summary, the induction cliff's keys kept only where the timeline reaches induction, the sweep
report's switch columns and analysis.stages' nearest switch."""

from __future__ import annotations

import math

import numpy as np

from analysis.stages import nearest_switch, strategy_switches
from metrics.dynamics.stages import Boundary
from reports.strategy_timeline import read_timeline, timeline_summary, without_false_cliff
from reports.sweep_report import switch_values

STEPS = np.arange(0, 1000, 10, dtype=float)


def series_of(kls: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> dict:
    out = {f"strategies/kl/{n}": (STEPS, v) for n, v in kls.items()}
    out.update({f"strategies/weight/{n}": (STEPS, v) for n, v in weights.items()})
    return out


def ramp(start: float, end: float, at: float) -> np.ndarray:
    return np.where(STEPS < at, start, end)


def test_a_run_that_stops_at_copy_loses_the_induction_cliffs_keys():
    kls = {"uniform": ramp(0.1, 3.0, 300), "copy": ramp(2.0, 1.0, 300), "induction": np.full(len(STEPS), 3.5)}
    weights = {"uniform": ramp(1.0, 0.2, 300), "copy": ramp(0.0, 0.8, 300), "induction": np.zeros(len(STEPS))}
    timeline = read_timeline(series_of(kls, weights))
    summary = {**timeline_summary(timeline), "phase_change/loss_onset_step": 280.0, "final/loss/repeated": 2.7}
    assert summary["strategies/switch/1"] == "uniform → copy" and summary["strategies/switch/1/step"] == 300
    assert summary["strategies/rise/copy_step"] == 300 and "strategies/rise/induction_step" not in summary
    kept = without_false_cliff(summary, timeline)
    assert "phase_change/loss_onset_step" not in kept and kept["final/loss/repeated"] == 2.7
    assert "no switch to the induction strategy" in kept["phase_change/left_out"]


def test_a_run_that_reaches_induction_keeps_them():
    kls = {
        "uniform": ramp(0.1, 3.0, 300),
        "copy": ramp(2.0, 1.0, 300) + ramp(0, 2, 600),
        "induction": ramp(3.5, 0.5, 600),
    }
    weights = {n: np.full(len(STEPS), 1 / 3) for n in kls}
    timeline = read_timeline(series_of(kls, weights))
    assert [s.label for s in timeline.switches] == ["uniform → copy", "copy → induction"]
    summary = {"phase_change/loss_onset_step": 580.0}
    assert without_false_cliff(summary, timeline) == summary
    assert without_false_cliff(summary, None) == summary  # a run without strategies: as before


def test_sweep_and_stages_read_the_switches_from_the_summary():
    summary = {
        "strategies/switch/1": "uniform → unigram",
        "strategies/switch/1/step": 40.0,
        "strategies/switch/1/low": 20.0,
        "strategies/switch/1/high": 60.0,
        "strategies/switch/2": "unigram → bigram",
        "strategies/switch/2/step": 600.0,
        "strategies/switch/3": "unigram → bigram",
        "strategies/switch/3/step": 900.0,
    }
    assert switch_values(summary) == {
        "switch uniform->unigram": 40.0,
        "switch unigram->bigram": 600.0,
        "switch unigram->bigram #2": 900.0,
    }
    switches = strategy_switches(summary)
    assert [s["label"] for s in switches] == ["uniform → unigram", "unigram → bigram", "unigram → bigram"]
    assert math.isnan(switches[1]["low"])
    boundary = Boundary(
        step=560.0, source="llc", kind="slope", low=520.0, high=620.0, support=0.9, statistic=3.0, statistic_name="t"
    )
    near = nearest_switch(boundary, switches)
    assert near["label"] == "unigram → bigram" and near["distance"] == -40.0 and near["inside"]
    outside = Boundary(
        step=200.0, source="llc", kind="slope", low=150.0, high=250.0, support=0.9, statistic=3.0, statistic_name="t"
    )
    assert not nearest_switch(outside, switches)["inside"] and nearest_switch(outside, []) is None
