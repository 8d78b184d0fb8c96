"""reports.rise against curves whose timing is known: a measure that is the ablation's own curve
rescaled, one that rises 50 steps earlier, and one that never moves; then the command on such a run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from records.layout import HYDRA_DIR, HYDRA_OVERRIDES, SUMMARY_NAME, TENSORS_DIR
from records.tensor_store import TensorStore
from reports.rise import TRUTH, main, rise_table

STEPS = np.arange(0, 1501, 10)
PAIR = (0, 1, 1, 0)  # the circuit: L0H1 -> L1H0


def logistic(centre: float, width: float = 25.0) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(STEPS - centre) / width))


def write_run(run_dir, curves: dict[str, np.ndarray], phase_change: dict[str, float] | None) -> None:
    """A run directory holding ``curves`` as the circuit pair's series (every other pair a constant
    0.05, the loss effect largest on the circuit) and ``phase_change`` in its summary."""
    (run_dir / HYDRA_DIR).mkdir(parents=True)
    (run_dir / HYDRA_DIR / HYDRA_OVERRIDES).write_text("[]\n")
    summary = {f"phase_change/loss_{k}_step": v for k, v in (phase_change or {}).items()}
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary))
    with TensorStore(run_dir / TENSORS_DIR) as store:
        for i, step in enumerate(STEPS):
            record = {}
            for name, curve in curves.items():
                values = np.full((2, 2, 2, 2), 0.05, dtype=np.float32)
                values[PAIR] = curve[i]
                record[name] = values
            store.append(int(step), record)


@pytest.fixture
def known_run(tmp_path):
    truth = 0.4 * logistic(400)
    curves = {
        "ablation/pattern_change": truth,
        "ablation/loss_change": 2 * truth,
        "comp/K/same_curve": 0.03 + 0.87 * logistic(400),  # the truth's own timing, another scale
        "comp/K/earlier": 0.9 * logistic(350),  # rises 50 steps before the truth
        "comp/K/flat": np.full(len(STEPS), 0.2),  # never moves: no rise to speak of
    }
    run_dir = tmp_path / "run"
    write_run(run_dir, curves, {"onset": 340.0, "midpoint": 400.0, "end": 460.0})
    return run_dir


def test_a_measure_on_the_truths_own_curve_reads_no_gap_and_one_rising_earlier_leads_by_its_shift(known_run):
    label, rows = rise_table(known_run)
    assert label.startswith("L0H1->L1H0") and label.endswith(f"the ablation at {len(STEPS)} steps")
    assert list(rows)[0] == TRUTH
    same, earlier, truth = rows["same_curve"], rows["earlier"], rows[TRUTH]
    assert same["gap"] == pytest.approx(0.0, abs=1e-6)
    assert same["half_minus_truth"] == pytest.approx(0.0, abs=1e-3)
    assert same["rise_at_onset"] == pytest.approx(truth["rise_at_onset"], abs=1e-6)
    expected_onset = 1 / (1 + math.exp(60 / 25))  # the logistic at 340, centre 400: 0.083
    assert truth["rise_at_onset"] == pytest.approx(expected_onset, abs=2e-3)  # linear between snapshots
    assert earlier["half_minus_truth"] == pytest.approx(-50.0, abs=0.5)
    assert earlier["rise_at_onset"] > truth["rise_at_onset"] + 0.2
    assert earlier["gap"] > 0.1
    assert same["before_onset"] == pytest.approx(0.03 + 0.87 * expected_onset, abs=2e-3)  # the raw value at 340
    assert same["after_end"] == pytest.approx(0.03 + 0.87 / (1 + math.exp(-60 / 25)), abs=2e-3)
    assert same["paced_at_onset"] == pytest.approx(same["before_onset"], abs=1e-4)  # it is paced as the truth
    assert earlier["paced_at_onset"] == pytest.approx(0.9 * expected_onset, abs=2e-3)  # had it risen with the truth
    assert earlier["before_onset"] > earlier["paced_at_onset"] + 0.2  # it reads more: it rises first
    flat = rows["flat"]
    assert math.isnan(flat["gap"]) and math.isnan(flat["half_minus_truth"])  # no rise: NaN, not a number


def test_the_command_prints_each_run_and_the_spread_over_runs(tmp_path, capsys):
    for seed, centre in enumerate((390, 410)):
        truth = 0.4 * logistic(centre)
        curves = {"ablation/pattern_change": truth, "ablation/loss_change": truth, "comp/K/m": logistic(centre - 20)}
        write_run(
            tmp_path / "sweep" / str(seed), curves, {"onset": centre - 60, "midpoint": centre, "end": centre + 60}
        )
    assert main([str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert out.count("L0H1->L1H0") == 2 and "over 2 runs" in out
    spread_line = out.splitlines()[-1]
    assert spread_line.split()[0] == "m" and "-20 ± 0" in spread_line  # both runs lead by 20 steps


def test_a_run_without_a_phase_change_or_an_ablation_is_refused_in_one_line(tmp_path, capsys):
    write_run(tmp_path / "a", {"comp/K/m": logistic(400)}, {"onset": 340.0, "midpoint": 400.0, "end": 460.0})
    assert main([str(tmp_path / "a")]) == 1
    assert "no ablation/pattern_change" in capsys.readouterr().err
    write_run(tmp_path / "b", {"ablation/pattern_change": logistic(400)}, None)
    assert main([str(tmp_path / "b")]) == 1
    assert "no loss phase change" in capsys.readouterr().err
    assert main([str(tmp_path / "nothing")]) == 1
    assert "no run directory" in capsys.readouterr().err
