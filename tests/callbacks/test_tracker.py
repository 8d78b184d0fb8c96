"""The tracker logs what it measures and never changes training."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from data.probe import make_probe_batch
from records.tracker_cost import HEATMAPS, WITH_ALL, TrackerCost
from reports.run_report import read_series
from tests.helpers import SMALL, LossRecorder, fit_repeated, quiet_trainer, tracker_of, tracker_settings

SHAPE = SMALL


def fit(tmp_path, tracker: bool, steps: int = 30, accumulate: int = 1, ablation_every: int = 0):
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    callbacks = [recorder]
    tracker_cb = None
    if tracker:
        settings = tracker_settings(
            "every_n_steps=5",
            f"ablation.every_n_steps={ablation_every}",
            "writes.every_n_steps=5",
            "matching.every_n_steps=5",
            "images.every_n_steps=0",
            "baseline_samples=100",
            "measures=[frobenius,subspace]",
            "cost_report=false",
        )
        tracker_cb = tracker_of(make_probe_batch(0, 8, 8, 20), settings)
        callbacks.append(tracker_cb)
    trainer = quiet_trainer(
        callbacks,
        steps,
        CSVLogger(tmp_path, name="csv", version=""),
        log_every_n_steps=5,
        gradient_clip_val=1.0,
        accumulate_grad_batches=accumulate,
    )
    module = fit_repeated(trainer, warmup_steps=5)
    return recorder.losses, module, tracker_cb, trainer


def test_tracker_does_not_perturb_training(tmp_path):
    without, module_a, _, _ = fit(tmp_path / "a", tracker=False)
    with_tracker, module_b, tracker, _ = fit(tmp_path / "b", tracker=True, ablation_every=10)
    assert tracker.last_step == 30
    assert without == with_tracker  # bit-identical loss curve
    for a, b in zip(module_a.parameters(), module_b.parameters()):
        assert torch.equal(a, b)
    assert module_b.model.training  # the inner model's mode restored


def test_small_snapshots_run_on_one_thread_without_torchs_thread_setting(tmp_path, monkeypatch):
    """The tracker switches a small model's snapshots to one thread by OpenMP alone:
    ``torch.set_num_threads`` would turn MKL's dynamic threading off and slow every later training
    step (docs/operations.md, "Threads")."""
    import callbacks.tracker

    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)  # a worker of the suite may run on one: the switch needs two to show
    try:
        calls, seen = [], []
        monkeypatch.setattr(torch, "set_num_threads", calls.append)
        measure = callbacks.tracker.measure

        def recorded(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return measure(*args, **kwargs)

        monkeypatch.setattr(callbacks.tracker, "measure", recorded)
        fit(tmp_path, tracker=True, steps=10)
        assert calls == []
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads_before)


def test_snapshot_leaves_rng_and_mode_alone():
    """Training here draws no random numbers after init, so the loss test alone could not see a
    snapshot that consumed RNG state; check the state and the mode directly."""
    from metrics.composition.measures import WEIGHT_MEASURES
    from metrics.snapshot import take_snapshot
    from models.transformer import AttentionOnlyTransformer

    model = AttentionOnlyTransformer(SHAPE)
    probe = make_probe_batch(0, 4, 8, 20)
    for training in (True, False):
        model.train(training)
        state = torch.random.get_rng_state()
        take_snapshot(model, probe, composition={"measures": list(WEIGHT_MEASURES), "baseline_samples": 50})
        assert torch.equal(torch.random.get_rng_state(), state)
        assert model.training == training


def test_tracker_logs_at_every_nth_optimizer_step(tmp_path):
    *_, trainer = fit(tmp_path, tracker=True, steps=20, accumulate=2)
    trainer.loggers[0].save()
    series = read_series(tmp_path / "csv" / "metrics.csv")
    steps, _ = series["comp/K/frobenius/L0H0->L1H1"]
    assert steps.tolist() == [0, 5, 10, 15, 20]  # once per optimizer step, despite accumulation
    assert "comp/K/frobenius/L1H0->L0H0" not in series  # masked pairs are never logged
    for key in (
        "heads/induction/L1H0",
        "heads/prev_token/top",
        "heads/copying/L0H1",
        "match/L0H0->L1H1",
        "loss/repeated",
        "circuit/K/frobenius_minus_baseline",
        "comp/baseline/frobenius_stderr",
    ):
        assert series[key][0].tolist() == [0, 5, 10, 15, 20], key


def test_ablation_and_validity_are_logged_at_every_ablation_step(tmp_path):
    *_, trainer = fit(tmp_path, tracker=True, steps=25, ablation_every=10)
    trainer.loggers[0].save()
    series = read_series(tmp_path / "csv" / "metrics.csv")
    assert series["comp/K/frobenius/L0H0->L1H1"][0].tolist() == [0, 5, 10, 15, 20, 25]
    for key in (
        "ablation/loss_change/L0H0->L1H1",
        "ablation/pattern_change/L0H1->L1H0",
        "validity/loss_change/frobenius/rank_of_truth",
        "validity/pattern_change/subspace/rank_of_truth",
        "validity/loss_change/match/rank_of_truth",
    ):
        assert series[key][0].tolist() == [0, 10, 20, 25], key  # and the final step, whatever max_steps is
    assert "ablation/loss_change/L1H0->L0H0" not in series  # masked pairs never logged
    ranks = series["validity/pattern_change/frobenius/rank_of_truth"][1]
    assert set(ranks.tolist()) <= {1.0, 2.0, 3.0, 4.0}  # 4 pairs


def test_dense_measures_at_every_snapshot_the_others_on_their_own_schedule(tmp_path):
    """The dense measures are scored at every snapshot; every other tracked measure at the
    ``all_measures`` steps, at every ablation step (the ground truth judges every measure) and at
    the last step. What the heads write (copying, OV copying, successor) runs on its own steps. The ledger
    books the two kinds of composition apart, and the cost model charges the other measures' extra
    seconds at their own period."""
    L.seed_everything(0, verbose=False)
    settings = tracker_settings(
        "every_n_steps=5",
        "ablation.every_n_steps=15",
        "writes.every_n_steps=10",
        "matching.every_n_steps=0",
        "images.every_n_steps=0",
        "all_measures.every_n_steps=10",
        "whitening.every_n_steps=10",
        "baseline_samples=100",
        "measures=[frobenius,sv_bound,whitened,whitened_resid]",
        "dense_measures=[frobenius,subspace]",
        "cost_report=false",
        "max_pair_keys=50",
    )
    tracker = tracker_of(
        make_probe_batch(0, 8, 8, 20), settings
    )  # 4 pairs: 36 keys for frobenius alone, 108 for all four
    trainer = quiet_trainer([tracker], 27, CSVLogger(tmp_path, name="csv", version=""), log_every_n_steps=5)
    fit_repeated(trainer, warmup_steps=0)
    trainer.loggers[0].save()
    series = read_series(tmp_path / "csv" / "metrics.csv")
    assert tracker.quantity("composition").dense() == (
        "frobenius",
    )  # a dense measure the run does not track is not scored
    assert series["comp/K/frobenius/max"][0].tolist() == [0, 5, 10, 15, 20, 25, 27]
    for measure in ("sv_bound", "whitened", "whitened_resid"):
        assert series[f"comp/K/{measure}/max"][0].tolist() == [0, 10, 15, 20, 27], measure
        assert series[f"validity/loss_change/{measure}/rank_of_truth"][0].tolist() == [0, 15, 27], measure
    assert not any(key.startswith("comp/") and "subspace" in key for key in series)
    for key in ("heads/copying/L0H0", "heads/ov_copying/L0H0", "heads/successor/L0H0"):
        assert series[key][0].tolist() == [0, 10, 20, 27], key
    # the run's four measures decide the mode at every step, also where frobenius alone would fit per pair
    assert not any("->" in key for key in series if key.startswith("comp/"))
    ledger = tracker.cost.ledger
    assert ledger.runs["composition"] == 2 and ledger.runs[WITH_ALL] == 5  # steps 5, 25; 0, 10, 15, 20, 27
    seconds = {
        "probe": 0.004,
        "behaviour": 0.001,
        "logging": 0.001,
        "composition": 0.002,
        WITH_ALL: 0.007,
        "writes": 0.003,
    }
    per_step = tracker.cost.amortised_seconds_per_step(seconds)
    assert per_step["snapshot"] == pytest.approx(0.008 / 5) and per_step["other measures"] == pytest.approx(0.005 / 10)
    assert per_step["writes"] == pytest.approx(0.003 / 10)
    tracker.quantity("composition").options.all_measures.every_n_steps = 0  # every snapshot: all charged to each
    assert tracker.cost.amortised_seconds_per_step(seconds)["snapshot"] == pytest.approx(0.013 / 5)
    assert "other measures" not in tracker.cost.amortised_seconds_per_step(seconds)


def test_cost_report_estimates_the_training_step_time(tmp_path, capsys):
    """The report subtracts only the tracker time spent after its clock started (a slow first
    heatmap once made it read 0 ms/step); the estimate lands near the measured step time."""
    *_, trainer = fit(tmp_path, tracker=False, steps=1)  # warm-up: imports, first-call costs
    settings = tracker_settings(
        "every_n_steps=5",
        "ablation.every_n_steps=0",
        "writes.every_n_steps=0",
        "matching.every_n_steps=0",
        "images.every_n_steps=0",
        "baseline_samples=100",
        "measures=[frobenius]",
    )
    tracker = tracker_of(make_probe_batch(0, 8, 8, 20), settings)
    trainer = quiet_trainer([tracker], 12)
    start = time.perf_counter()
    fit_repeated(trainer, warmup_steps=0)
    per_step_upper = 1000 * (time.perf_counter() - start) / 5  # ms: a loose upper bound per training step
    report = capsys.readouterr().out
    line = next(line for line in report.splitlines() if "ms/step" in line)
    step_ms = float(line.split("training ")[1].split(" ms/step")[0])
    overhead = float(line.split("overhead ")[1].split("%")[0])
    snapshot_ms = float(report.split(" steps costs ")[1].split(" ms")[0])
    assert 0.05 < step_ms < per_step_upper, line
    # every part runs every 5 steps here: the overhead is a snapshot's cost over 5 steps' training,
    # within what printing each figure to 0.1 (ms, %) leaves of it
    low, high = 100 * (snapshot_ms - 0.05) / 5 / (step_ms + 0.05), 100 * (snapshot_ms + 0.05) / 5 / (step_ms - 0.05)
    assert low - 0.05 <= overhead <= high + 0.05, report
    assert "tracker: " in report and "snapshots in" in report  # the totals at the end


def test_the_closing_line_says_what_the_tracker_cost_the_run_since_its_first_snapshot():
    """The early report estimates the overhead from one interval; the closing line gives the run's own: the
    tracker's seconds after its first snapshot over the training seconds in that time. On an ensemble
    member's clock (training only): 0.3 s of first snapshot, then four of 0.1 s and heatmaps of 0.2 s over
    10 s of training is 6 %; before the clock starts there is no share to say."""
    cost = TrackerCost([], every_n_steps=10)
    cost.ledger.add("snapshot", 0.3)
    assert cost.measured_share(training_clock=0.0) is None
    assert cost.report_once(0, training_clock=0.0) is None  # the first snapshot starts the clock
    for _ in range(4):
        cost.ledger.add("snapshot", 0.1)
    cost.ledger.add(HEATMAPS, 0.2)
    assert cost.measured_share(training_clock=10.0) == pytest.approx(0.06)
    line = cost.totals_line(training_clock=10.0)
    assert line.startswith("tracker: 5 snapshots in 0.7 s") and line.endswith(
        "; 6.0% of the training time since the first"
    ), line


def test_cost_report_leaves_out_the_first_heatmaps_until_drawn_again():
    """The first heatmaps pay W&B's one-time set-up (476 ms once, ~40 ms after, in a real run): the
    estimate charges heatmaps only from their second drawing, and the report says so meanwhile."""
    settings = tracker_settings(
        "every_n_steps=10",
        "ablation.every_n_steps=0",
        "writes.every_n_steps=0",
        "matching.every_n_steps=0",
        "images.every_n_steps=200",
        "all_measures.every_n_steps=0",
        "measures=[frobenius]",
        "cost_report=false",
    )
    tracker = tracker_of(make_probe_batch(0, 8, 8, 20), settings)
    for part, seconds in (
        ("probe", 0.002),
        ("loss_views", 0.001),
        ("composition", 0.001),
        ("logging", 0.001),
        ("images", 0.4),
    ):
        tracker.cost.ledger.add(part, seconds)
    assert tracker.cost.amortised_seconds_per_step() == {"snapshot": pytest.approx(0.005 / 10)}
    lines = tracker.cost.lines(step_seconds=0.01)
    assert "the first took 400.0 ms with W&B's one-time set-up; not in the estimate" in lines
    assert "expected tracker overhead 5.0%" in lines
    tracker.cost.ledger.add("images", 0.04)
    assert tracker.cost.amortised_seconds_per_step()["images"] == pytest.approx(0.04 / 200)
    assert "heatmaps 40.0 ms every 200" in tracker.cost.lines(step_seconds=0.01)


class PoisonWeights(L.Callback):
    """Make one weight NaN after optimizer step ``at``: what a diverging run does to the tracker."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            with torch.no_grad():
                next(pl_module.model.parameters()).view(-1)[0] = float("nan")


def test_non_finite_weights_are_logged_as_nan_with_the_reason_not_a_crash(tmp_path, capsys):
    settings = tracker_settings(
        "every_n_steps=5",
        "ablation.every_n_steps=5",
        "writes.every_n_steps=5",
        "matching.every_n_steps=5",
        "images.every_n_steps=0",
        "baseline_samples=100",
        "measures=[frobenius,subspace]",
        "cost_report=false",
    )
    tracker = tracker_of(make_probe_batch(0, 8, 8, 20), settings)
    trainer = quiet_trainer(
        [PoisonWeights(at=7), tracker], 15, CSVLogger(tmp_path, name="csv", version=""), log_every_n_steps=5
    )
    fit_repeated(trainer, warmup_steps=5)
    assert "tracker: step 10 not measured, logged as NaN: the weights are not finite" in capsys.readouterr().out
    series = read_series(tmp_path / "csv" / "metrics.csv")
    steps, values = series["comp/K/frobenius/L0H0->L1H0"]
    assert list(steps) == [0, 5, 10, 15]
    assert all(torch.isfinite(torch.tensor(values[:2]))) and all(torch.isnan(torch.tensor(values[2:])))
    assert list(series["tracker/unmeasurable"][0]) == [10, 15]
