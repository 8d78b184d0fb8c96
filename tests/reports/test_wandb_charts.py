"""The comparison charts' data, from series and jobs with known values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metrics.dynamics.phase_change import PhaseChange
from reports.sweep_report import Job
from reports.wandb_charts import PHASE_CHANGE_LINE, circuit_composition_chart, sweep_loss_chart, sweep_midpoints


def test_the_circuit_chart_normalises_each_measure_to_its_baseline_and_marks_the_change():
    steps = np.array([0.0, 10.0, 20.0])
    series = {
        "circuit/K/frobenius": (steps, np.array([0.125, 0.5, 1.0])),
        "circuit/K/frobenius_minus_baseline": (steps, np.array([0.0, 0.375, 0.875])),
        "comp/baseline/frobenius": (steps, np.array([0.125, 0.125, 0.125])),
        "circuit/K/subspace": (steps, np.array([0.5, 0.75, 0.5])),
        "comp/baseline/subspace": (steps, np.array([0.5, 0.5, 0.5])),
        "loss/repeated": (steps, np.array([4.0, 2.0, 1.0])),
    }
    chart = circuit_composition_chart(series, PhaseChange(5.0, 10.0, 15.0, 4.0, 1.0))
    assert chart.lines["frobenius"] == ([0.0, 10.0, 20.0], pytest.approx([0.0, 0.375 / 0.875, 1.0]))
    assert chart.lines["subspace"][1] == pytest.approx([0.0, 0.5, 0.0])
    assert chart.lines[PHASE_CHANGE_LINE] == ([5.0, 15.0], [1.0, 1.0])
    assert list(chart.lines) == ["frobenius", "subspace", "repeated-token loss / its step-0 value", PHASE_CHANGE_LINE]


def test_sweep_charts_take_numeric_settings_and_finite_midpoints_only():
    curve = (np.array([0.0, 10.0]), np.array([5.0, 1.0]))
    jobs = [
        Job(Path("0"), {"model.n_heads": "2"}, "finished", values={"phase_change_midpoint": 400.0}, loss_curve=curve),
        Job(Path("1"), {"model.n_heads": "4"}, "finished", values={"phase_change_midpoint": float("nan")}),
        Job(Path("2"), {"model.n_heads": "x"}, "finished", values={"phase_change_midpoint": 300.0}),
    ]
    assert sweep_midpoints(jobs, "model.n_heads") == [(2.0, 400.0)]
    assert sweep_loss_chart(jobs).lines == {"0: model.n_heads=2": ([0.0, 10.0], [5.0, 1.0])}
