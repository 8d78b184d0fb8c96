"""``python -m bench.throughput``: the documented overhead benchmark runs, and its steady-state line
charges each part at its own period."""

from __future__ import annotations

import json

import pytest

from bench.throughput import main
from records.tracker_cost import WITH_ALL

pytestmark = pytest.mark.slow


def test_the_benchmark_runs_and_its_steady_state_charges_each_part_at_its_period(tmp_path, capsys):
    out = tmp_path / "results.json"
    results = main(["--steps", "20", "--repeats", "1", "--out", str(out), "tracker.writes.every_n_steps=20"])
    printed = capsys.readouterr().out
    assert "tracker overhead" in printed and "steady state" in printed
    assert json.loads(out.read_text())["tracker_overhead_steady_state"] == pytest.approx(
        results["tracker_overhead_steady_state"]
    )
    ms = results["tracker_part_ms"]
    every_snapshot = (
        "probe",
        "loss_views",
        "behaviour",
        "circuit",
        "logging",
    )
    per_10_steps = sum(ms[part] for part in every_snapshot) + ms["composition"]  # every 10 steps: Frobenius alone
    others = ms[WITH_ALL] - ms["composition"]  # what every other measure adds, every 100
    per_step = (
        per_10_steps / 10
        + (others + ms["matching"] + ms["ablation"] + ms["validity"]) / 100
        + (ms["writes"] + ms["strategies"]) / 20
    )
    step_ms = 1000 * results["median_seconds"]["lightning"] / 20
    assert results["tracker_overhead_steady_state"] == pytest.approx(per_step / step_ms, rel=1e-9)
    fastest_ms = 1000 * min(results["seconds"]["lightning"]) / 20  # one repeat here: the median's run
    assert results["tracker_overhead_steady_state_fastest"] == pytest.approx(per_step / fastest_ms, rel=1e-9)
