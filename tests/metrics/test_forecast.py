"""The phase change's forecast (metrics/dynamics/forecast.py): the rule on planted escapes whose midpoint
is known, no forecast on a flat loss, a fitted forecaster that learns a planted correction and its
planted law, its file refused for another task or shape (one line, before training), and the default
run's own forecasts read back into its summary (reports/forecast_report.py)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from analysis.forecast import main as forecast_main
from conf.validate import forecaster_problems
from metrics.dynamics.forecast import (
    FORECAST_KEYS,
    LOSS,
    Forecaster,
    History,
    PriorLaw,
    fit_forecaster,
    fit_prior_law,
    forecast_at,
    forecasts_along,
    rule_forecast,
)
from tests.helpers import composed

L0 = math.log(256)


def escape(rate: float, midpoint: float, steps: np.ndarray, rng: np.random.Generator, noise: float = 0.003):
    """A repeated-token loss that leaves ``L0`` exponentially (``d = L0/2 · exp(rate · (t − midpoint))``)
    and falls to 0.1 after ``midpoint``: the rule's own picture, its midpoint known (``rate · midpoint``
    ≥ 6: the loss starts within a hundredth of a nat of ``L0``, as a real run's does)."""
    distance = np.minimum(L0 / 2 * np.exp(rate * (steps - midpoint)), L0 - 0.1)
    return L0 - distance + noise * rng.standard_normal(len(steps))


def test_the_rule_finds_a_planted_escapes_midpoint_from_half_way_and_covers_it():
    rng = np.random.default_rng(0)
    steps = np.arange(0, 3001, 10.0)
    errors, covered = [], []
    for rate, midpoint in [(0.008, 800.0), (0.012, 500.0), (0.004, 1500.0), (0.005, 1200.0)]:
        loss = escape(rate, midpoint, steps, rng)
        at = steps <= midpoint / 2 + 1e-9
        f = rule_forecast(steps[at], loss[at], max_steps=3000)
        errors.append(f.midpoint / midpoint - 1)
        covered.append(f.low <= midpoint <= f.high)
        assert f.p_before_end > 0.9
    assert max(map(abs, errors)) < 0.1, errors  # the smoothing lags the last points: a few per cent
    assert all(covered), errors


def test_a_flat_loss_gets_no_forecast_and_a_slow_one_no_alarm():
    rng = np.random.default_rng(1)
    steps = np.arange(0, 1501, 10.0)
    flat = L0 + 0.01 * rng.standard_normal(len(steps))
    assert math.isnan(rule_forecast(steps, flat, 3000).midpoint)
    slow = escape(0.001, 4500.0, steps, rng, noise=0.0005)  # escapes well beyond max_steps
    f = rule_forecast(steps, slow, 3000)
    assert f.midpoint > 3000 and f.p_before_end < 0.2


def planted_history(rng, rate: float, midpoint: float, batch: int) -> History:
    steps = np.arange(0, midpoint * 1.3, 10.0)
    loss = escape(rate, midpoint, steps, rng)
    series = {LOSS: loss}
    return History(steps, series, 3000.0, {"data.batch_size": str(batch), "seed": "0"}, midpoint)


def test_a_fitted_forecaster_corrects_a_rule_that_is_off_and_learns_the_planted_law():
    """Runs whose loss escapes at a rate the rule misreads (a second, slower escape first): the fitted
    forecaster, judged on runs it was not fitted on, does better than the rule; its law's exponent is
    the planted one."""
    rng = np.random.default_rng(2)

    def run(batch: int) -> History:
        midpoint = 4000 * batch**-0.5 * math.exp(0.05 * rng.standard_normal())
        h = planted_history(rng, 6 / midpoint, midpoint, batch)
        slow = 0.02 * L0 * np.minimum(h.steps / midpoint, 1)  # a slow early fall the rule reads as escape
        return History(h.steps, {LOSS: h.series[LOSS] - slow}, h.max_steps, h.settings, midpoint)

    train = [run(b) for b in (4, 8, 16, 32) for _ in range(3)]
    test = [run(b) for b in (4, 8, 16, 32)]
    law = fit_prior_law([h.settings for h in train], [h.midpoint for h in train], [False] * 12, ["data.batch_size"], [])
    assert law.exponents["data.batch_size"] == pytest.approx(-0.5, abs=0.05)
    forecaster = fit_forecaster(train, "repeated", {"n_layers": 2}, law)

    def error(h: History, f) -> float:
        return abs(forecast_at(forecasts_along(h, f), 0.5 * h.midpoint).midpoint / h.midpoint - 1)

    fitted = [error(h, forecaster) for h in test]
    rule = [error(h, None) for h in test]
    assert np.median(fitted) < 0.08 and np.median(fitted) < np.median(rule), (fitted, rule)


def test_a_forecaster_file_round_trips_and_is_refused_for_another_task_or_shape(tmp_path):
    rng = np.random.default_rng(3)
    histories = [planted_history(rng, 0.006, m, 8) for m in (600.0, 700.0, 800.0)]
    model = composed().model
    shape = {k: model[k] for k in ("n_layers", "n_heads", "d_model", "d_head", "d_vocab")}
    forecaster = fit_forecaster(histories, "repeated", shape, PriorLaw(math.log(700), {}, 0.1))
    path = tmp_path / "forecaster.json"
    forecaster.save(path)
    again = Forecaster.load(path)
    h = histories[0]
    assert forecasts_along(h, again) == forecasts_along(h, forecaster)
    assert forecaster_problems(composed(), str(path)) == []
    [other_task] = forecaster_problems(composed("data=markov_icl"), str(path))
    assert "fitted on task 'repeated', this run's is 'markov_icl'" in other_task and "\n" not in other_task
    [other_shape] = forecaster_problems(composed("model.n_heads=4"), str(path))
    assert "model.n_heads=2 there, 4 here" in other_shape
    damaged = tmp_path / "damaged.json"
    damaged.write_text(path.read_text()[:100])
    [line] = forecaster_problems(composed(), str(damaged))
    assert line.startswith(f"tracker.forecaster={damaged}: damaged") and "\n" not in line
    [missing] = forecaster_problems(composed(), str(tmp_path / "none.json"))
    assert "no such file" in missing


def test_the_default_run_forecasts_its_phase_change_and_its_summary_says_what_at_each_way(
    shipped_run, tmp_path, capsys
):
    summary = json.loads((shipped_run.run_dir / "summary.json").read_text())
    midpoint = summary["phase_change/loss_midpoint_step"]
    assert summary["forecast/at_50/step"] <= 0.5 * midpoint
    assert abs(summary["forecast/at_75/midpoint_step"] / midpoint - 1) < 0.25
    assert summary["forecast/at_75/p_before_end"] > 0.8
    assert "forecast of the midpoint" in shipped_run.stdout
    header = (shipped_run.run_dir / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert set(FORECAST_KEYS) <= set(header)
    # a forecaster fitted on it (one run: no law) is written once; an --out onto another file is refused
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "0").symlink_to(shipped_run.run_dir)
    assert forecast_main(["fit", str(sweep)]) == 0
    assert Forecaster.load(sweep / "forecaster.json").runs == 1
    summary_copy = tmp_path / "summary.json"
    shutil.copy(shipped_run.run_dir / "summary.json", summary_copy)
    before = summary_copy.read_bytes()
    assert forecast_main(["fit", str(sweep), "--out", str(summary_copy)]) == 2
    assert summary_copy.read_bytes() == before
    assert "exists and this command did not write it" in capsys.readouterr().err


def test_a_resumed_run_logs_its_checkpoints_forecast_again_and_makes_no_other():
    """``callbacks.phase_change_forecast``: a run resumed at a step where it had forecast (its CSV rows from
    that step on were dropped; the tracker measures that step again) logs that forecast again, as it was;
    one resumed between snapshots logs nothing twice; a snapshot with no finite forecast logs no empty row."""
    from types import SimpleNamespace

    from callbacks.phase_change_forecast import PhaseChangeForecast

    class Recorder:
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step):
            self.rows.append((step, dict(metrics)))

    steps = np.arange(0, 1001, 10.0)
    loss = escape(0.01, 700.0, steps, np.random.default_rng(1))
    tracker = SimpleNamespace(latest=None)
    straight, trainer = PhaseChangeForecast(tracker, max_steps=1000, window=5), SimpleNamespace(loggers=[Recorder()])
    for step, value in zip(steps[:51], loss[:51]):  # to step 500, before the midpoint
        tracker.latest = (int(step), {LOSS: float(value)})
        straight.on_train_batch_end(trainer, None, None, None, 0)
    rows = trainer.loggers[0].rows
    assert rows and rows[-1][0] == 500 and all(metrics for _, metrics in rows)  # no empty row
    assert len(rows) < 49  # the first snapshots forecast nothing finite, and logged nothing
    for latest, again in (((500, {LOSS: float(loss[50])}), [rows[-1]]), (None, [])):
        resumed, recorder = PhaseChangeForecast(tracker, max_steps=1000, window=5), Recorder()
        resumed.load_state_dict(straight.state_dict())
        tracker.latest = latest  # step 500 measured again, or (resumed at 505) no snapshot yet
        resumed.on_train_batch_end(SimpleNamespace(loggers=[recorder]), None, None, None, 0)
        assert recorder.rows == again


@pytest.mark.parametrize(
    "intervention, n_layers, why",
    [
        (None, 2, None),
        (None, 1, "a 1-layer model has no earlier layer"),
        ({"kind": "ablate", "heads": ["L0"]}, 2, "every head below the last layer is ablated"),
        ({"kind": "ablate", "heads": ["L0H0"]}, 2, None),  # L0H1 can still be read
        ({"kind": "ablate", "heads": ["L0"]}, 3, None),  # layer 1 can be read by layer 2
        ({"kind": "ablate", "heads": ["L0"], "from_step": 100}, 2, None),  # free before step 100
        ({"kind": "ablate", "heads": ["L0"], "until_step": 500}, 2, None),  # free after step 500
        ({"kind": "clamp", "heads": ["L0"]}, 2, None),
        ({"kind": "ablate", "heads": ["L0H0"], "also": [{"kind": "ablate", "heads": ["L0H1"]}]}, 2, "ablated"),
    ],
)
def test_no_forecast_where_the_model_cannot_form_an_induction_circuit(intervention, n_layers, why):
    from metrics.dynamics.forecast import no_induction_circuit
    from models.interventions import plan_of, silenced_throughout

    said = no_induction_circuit(n_layers, 2, silenced_throughout(plan_of(intervention), 2))
    assert said == why if why is None else why in said
