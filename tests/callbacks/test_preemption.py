"""Stopped by a signal, resumed in place: the run ends as if it had never been interrupted.

Real subprocess runs of train.py, signalled as SLURM, ``timeout`` and a user's Ctrl-C would, read
back through the files a user gets: the CSV, the W&B offline run files, the checkpoints.

Bit-identity needs one thread: with two, two *uninterrupted* runs of the same seed already differ
in the last bit of a few losses (the order of a threaded reduction is not fixed from one process
to the next), so the comparison here runs at ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from records import wandb_records
from tests.helpers import NO_FIGURES, REPO, WITH_WANDB, run_train, run_train_until, train_env, wandb_history

pytestmark = pytest.mark.slow

ARGS = [
    "trainer.checkpoint_every_n_steps=25",
    "tracker.every_n_steps=5",
    "tracker.ablation.every_n_steps=10",
    "tracker.writes.every_n_steps=10",
    "tracker.whitening.every_n_steps=15",
    "tracker.images.every_n_steps=0",
    "trainer.log_every_n_steps=1",
    # a trigger that fires within the first tracker steps and stays on: the kill lands mid-change
    "trajectory.threshold=0.0001",
    "trajectory.settle=1e-9",
    "trajectory.window=1",
    "trajectory.log_steps=3",
    "trajectory.every_n_steps=0",
    WITH_WANDB,  # a signal lands while W&B's threads run, as a user's runs have them
]
SINGLE_THREAD = train_env(OMP_NUM_THREADS="1")


def csv_rows(run_dir) -> list[tuple[int, list[tuple[str, str]]]]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as file:
        return sorted((int(row["step"]), sorted((k, v) for k, v in row.items() if v)) for row in csv.DictReader(file))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    result = run_train([*ARGS, "trainer.max_steps=40"], run_dir, threads=1)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_sigterm_then_resume_in_place_equals_an_uninterrupted_run(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    code, printed = run_train_until(
        [f"hydra.run.dir={run_dir}", NO_FIGURES, *ARGS, "trainer.max_steps=40"],
        step=13,
        signum=signal.SIGTERM,
        env=SINGLE_THREAD,
    )
    assert code == 128 + signal.SIGTERM, printed[-3000:]
    stop_line = next(line for line in printed.splitlines() if line.startswith("stopped by SIGTERM at step "))
    step = int(stop_line.split("at step ")[1].split(";")[0])
    assert 13 <= step < 25  # mid-run, before the first periodic checkpoint (25)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == step
    (first_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_records.exit_code(first_file) == 128 + signal.SIGTERM  # not marked successful
    assert "stopped by SIGTERM" in (run_dir / "train.log").read_text()  # the console is in the run directory too
    assert f"resume={run_dir}" in stop_line

    resumed = run_train([*ARGS, "trainer.max_steps=40", f"resume={run_dir}"], run_dir, threads=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    rows = csv_rows(run_dir)
    assert rows == csv_rows(uninterrupted)  # the same CSV, bit for bit
    steps = [s for s, row in rows if any(k == "train/loss" for k, _ in row)]
    assert steps == list(range(40))  # every step's loss exactly once
    assert wandb_history(run_dir) == wandb_history(uninterrupted)
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({wandb_records.run_id(f) for f in files}) == 1  # one W&B run, continued
    assert wandb_records.exit_code(files[-1]) == 0
    final, reference = (
        torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        for d in (run_dir, uninterrupted)
    )
    assert final["global_step"] == reference["global_step"] == 40
    for key, tensor in reference["state_dict"].items():
        assert torch.equal(final["state_dict"][key], tensor), key
    assert (run_dir / "summary.json").read_text() == (uninterrupted / "summary.json").read_text()
    kept, reference_kept = (
        json.loads((d / "trajectory" / "index.json").read_text())["steps"] for d in (run_dir, uninterrupted)
    )
    assert kept == reference_kept  # the same steps, each once, for the same reasons
    adaptive = sorted(int(s) for s, entry in kept.items() if "adaptive" in entry["reasons"])
    assert adaptive[0] < step < adaptive[-1]  # stopped while the trigger was on
    for entry in kept.values():
        assert (run_dir / "trajectory" / entry["file"]).read_bytes() == (
            uninterrupted / "trajectory" / entry["file"]
        ).read_bytes()
    assert (run_dir / ".hydra" / "overrides.yaml").is_file() and list(run_dir.glob(".hydra/resume-*/overrides.yaml"))


def test_a_signal_while_the_run_starts_stops_it_after_its_first_step_and_resume_equals_an_uninterrupted_run(
    tmp_path, uninterrupted
):
    """SIGTERM as soon as ``status.json`` says running (Lightning not loaded yet, seconds before training)."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        str(REPO / "train.py"),
        f"hydra.run.dir={run_dir}",
        NO_FIGURES,
        *ARGS,
        "trainer.max_steps=40",
    ]
    process = subprocess.Popen(
        command, cwd=REPO, env=SINGLE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started = time.monotonic()
    while not (run_dir / "status.json").is_file() and process.poll() is None and time.monotonic() - started < 120:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    printed = process.communicate(timeout=300)[0]
    assert process.returncode == 128 + signal.SIGTERM, printed[-3000:]
    assert "SIGTERM received while starting: stopping after the first step" in printed
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "preempted" and status["step"] == 1, status
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 1
    resumed = run_train([*ARGS, "trainer.max_steps=40", f"resume={run_dir}"], run_dir, threads=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert csv_rows(run_dir) == csv_rows(uninterrupted)  # every step once, bit for bit
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_ctrl_c_and_slurms_warning_signal_checkpoint_the_step_and_exit_non_zero(tmp_path, signum):
    code, printed = run_train_until(
        [
            f"hydra.run.dir={tmp_path}",
            "trainer.max_steps=200",
            "tracker.enabled=false",
            "logger=csv",
            "trainer.log_every_n_steps=1",
            # a trigger that fires within the first tracker steps and stays on: the kill lands mid-change
            "trajectory.threshold=0.0001",
            "trajectory.settle=1e-9",
            "trajectory.window=1",
            "trajectory.log_steps=3",
            "trajectory.every_n_steps=0",
        ],
        step=7,
        signum=signum,
    )
    assert code == 128 + signum, printed[-3000:]
    step = int(printed.split(f"stopped by {signum.name} at step ")[1].split(";")[0])
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step
    with open(tmp_path / "csv" / "metrics.csv", newline="") as file:
        logged = [int(row["step"]) for row in csv.DictReader(file)]
    assert max(logged) == step - 1  # every finished step's row was flushed, the stop step's included


def test_a_run_pointed_at_another_runs_directory_is_refused_untouched(tmp_path, uninterrupted):
    before = {p: p.stat().st_mtime_ns for p in uninterrupted.rglob("*")}
    result = run_train(["trainer.max_steps=5", "tracker.enabled=false"], uninterrupted)
    assert result.returncode != 0
    assert "already holds a run" in result.stderr and f"resume={uninterrupted}" in result.stderr
    assert {p: p.stat().st_mtime_ns for p in uninterrupted.rglob("*")} == before  # nothing written, nothing deleted


def test_a_resume_that_changes_the_model_is_refused_naming_the_keys(tmp_path, uninterrupted):
    run_dir = tmp_path / "fork"
    result = run_train(
        [*ARGS, "trainer.max_steps=50", "model.n_heads=4", "data.seed=3", f"resume={uninterrupted}"], run_dir
    )
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert "model.n_heads: 2 -> 4" in error and "data.seed: 0 -> 3" in error, error
    assert not run_dir.exists()
    allowed = run_train(
        [
            *ARGS,
            "trainer.max_steps=45",
            "data.seed=3",
            "resume_allow_changes=true",
            f"resume={uninterrupted}",
            "logger=csv",
        ],
        run_dir,
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert min(step for step, _ in csv_rows(run_dir)) == 40  # a fork: its own directory, from the checkpoint's step
