"""The strategy timeline as the reports read it: from a run's series, the switches and rises named in
its summary, the induction cliff's keys kept only where the timeline reaches induction (kept, unchecked,
where the strategies are the generic ones), the sweep report's switch columns and analysis.stages'
nearest switch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.stages import nearest_switch, strategy_switches
from metrics.dynamics.stages import Boundary
from reports.strategy_timeline import generic_strategies, read_timeline, timeline_summary, without_false_cliff
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


def test_generic_strategies_that_find_no_switch_keep_the_cliff_and_say_it_is_unchecked():
    """A task that names no strategies of its own is scored on the generic ones at every position: no
    switch to induction there is not a timeline that shows none (a run of the task's own strategies)."""
    kls = {"uniform": np.full(len(STEPS), 0.2), "copy": np.full(len(STEPS), 2.0), "induction": ramp(4.0, 3.0, 500)}
    weights = {"uniform": ramp(1.0, 0.95, 500), "copy": np.zeros(len(STEPS)), "induction": ramp(0.0, 0.05, 500)}
    timeline = read_timeline(series_of(kls, weights))
    assert timeline.switches == [] and timeline.rises == {} and not timeline.reaches_cliff
    summary = {"phase_change/loss_onset_step": 480.0, "phase_change/induction_midpoint_step": 510.0, "final/x": 1.0}
    generic = without_false_cliff(summary, timeline, generic=True)
    assert {k: generic[k] for k in summary} == summary and "phase_change/left_out" not in generic
    assert "names no strategies of its own" in generic["phase_change/unchecked"]
    own = without_false_cliff(summary, timeline)
    assert own == {
        "final/x": 1.0,
        "phase_change/left_out": "no switch to the induction strategy: see strategies/switch/*",
    }
    assert without_false_cliff({"final/x": 1.0}, timeline, generic=True) == {"final/x": 1.0}  # no cliff: nothing to say


def test_only_a_task_without_a_reference_of_its_own_is_generic(monkeypatch):
    from data import task as task_module

    class Plain(task_module.Task):  # no name: never registered
        pass

    class Own(task_module.Task):
        def reference(self, sample_ids, n_random):
            return super().reference(sample_ids, n_random)

    assert not task_module.names_own_strategies(Plain) and task_module.names_own_strategies(Own)
    assert not any(generic_strategies(name) for name in task_module.tasks())  # every built-in task names its own
    monkeypatch.setattr(task_module, "tasks", lambda: {"plain": Plain, "own": Own})
    assert generic_strategies("plain") and not generic_strategies("own")
    assert not generic_strategies("unknown") and not generic_strategies(None)


def test_a_rise_of_induction_s_weight_without_a_switch_keeps_them_and_says_so():
    """A run that ends mid-transition (aslvrstn_2022_cpu at step 4000): induction's mixture weight rises
    through the loss's fall while uniform stays the closest strategy."""
    kls = {"uniform": ramp(0.05, 0.9, 500), "copy": ramp(0.9, 1.7, 500), "induction": ramp(4.5, 2.0, 500)}
    weights = {"uniform": ramp(1.0, 0.6, 500), "copy": ramp(0.0, 0.05, 500), "induction": ramp(0.0, 0.35, 500)}
    timeline = read_timeline(series_of(kls, weights))
    assert timeline.switches == [] and timeline.rises == {"induction": 500.0}
    assert timeline.reaches_cliff and timeline.cliff_switch is None
    summary = {"phase_change/loss_onset_step": 470.0, "phase_change/loss_midpoint_step": 490.0}
    kept = without_false_cliff(summary, timeline)
    assert {k: kept[k] for k in summary} == summary and "phase_change/left_out" not in kept
    assert kept["phase_change/confirmed_by"] == (
        "induction's mixture weight rises at step 500 (0.1 and held; 0.35 at step 990);"
        " no switch to induction: the closest strategy at the end is uniform"
    )
    assert without_false_cliff(summary, timeline, generic=True) == kept  # shown: nothing left unchecked


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
    assert without_false_cliff(summary, timeline) == summary  # a switch: nothing added
    assert timeline.cliff_switch.label == "copy → induction" and timeline.rise_without_switch() is None
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


def write_cliff_without_a_switch(run_dir, task_name: str | None) -> None:
    """A run directory whose repeated-token loss falls 5.5 -> 0.2 around step 400 while uniform stays
    the closest strategy and induction's weight stays under 0.1 (what generic strategies can read
    where most positions are unpredictable), trained on
    ``task_name`` (its ``.hydra/config.yaml``; None: a directory without one)."""
    import csv

    fall = 1 / (1 + np.exp(-(STEPS - 400) / 15.0))
    columns = {
        "loss/repeated": 5.5 - 5.3 * fall,
        "loss/first_occurrence": np.full(len(STEPS), 5.5),
        "heads/induction/top": 0.8 * fall,
        "heads/prev_token/top": 0.6 * fall,
        "comp/baseline/frobenius": np.full(len(STEPS), 0.125),
        "circuit/K/frobenius": 0.15 + 0.2 * fall,
        "circuit/K/frobenius_minus_baseline": 0.025 + 0.2 * fall,
        "strategies/kl/uniform": np.full(len(STEPS), 0.2),
        "strategies/kl/copy": np.full(len(STEPS), 2.0),
        "strategies/kl/induction": 4.0 - 1.0 * fall,
        "strategies/weight/uniform": 1.0 - 0.05 * fall,
        "strategies/weight/copy": np.zeros(len(STEPS)),
        "strategies/weight/induction": 0.05 * fall,  # below the 0.1 of a rise: no induction shown
    }
    (run_dir / "csv").mkdir(parents=True)
    with open(run_dir / "csv" / "metrics.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", *columns])
        writer.writerows([step, *(float(c[i]) for c in columns.values())] for i, step in enumerate(STEPS))
    if task_name is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(
            f"data:\n  name: {task_name}\ntracker:\n  smoothing_window: 5\n"
        )


def test_the_run_report_reads_the_run_s_task_to_tell_the_two_apart(tmp_path, monkeypatch):
    from data import task as task_module
    from reports import run_report

    class Plain(task_module.Task):  # no name: never registered; names no strategies of its own
        pass

    registered = task_module.tasks()
    monkeypatch.setattr(task_module, "tasks", lambda: {**registered, "plain": Plain})
    write_cliff_without_a_switch(tmp_path / "plain", "plain")
    write_cliff_without_a_switch(tmp_path / "repeated", "repeated")
    write_cliff_without_a_switch(tmp_path / "rescored", None)
    assert run_report.config_value(tmp_path / "plain", "data.name") == "plain"
    assert run_report.config_value(tmp_path / "rescored", "data.name") is None
    plain = run_report.render(tmp_path / "plain", 5).summary
    assert plain["phase_change/loss_midpoint_step"] == pytest.approx(400, abs=20)
    assert "phase_change/unchecked" in plain and "phase_change/left_out" not in plain
    for own in ("repeated", "rescored"):  # the task's own strategies, or nothing known of the task
        summary = run_report.render(tmp_path / own, 5).summary
        assert not any(key.startswith("phase_change/loss_") for key in summary)
        assert "phase_change/left_out" in summary and "phase_change/unchecked" not in summary
