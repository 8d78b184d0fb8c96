"""Real SLURM jobs, warned before their time limit (SIGUSR1), requeue themselves and finish their runs in place
(a single run and an ensemble, side by side on the cluster's two CPUs).

Needs a SLURM cluster (``sinfo`` answers): CI starts a single-node one (``.ci/start-local-slurm``) and
sets ``REQUIRE_SLURM=1``, so there the test fails rather than skips; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import FINISHED, REPO, job_field, slurm_is_up, start_requeued_job_now, wait_for

pytestmark = pytest.mark.slow

STEPS = 300
"""Long enough that the warning reaches the job while it trains, however late a loaded machine delivers
it: sent at step 15, it has ~285 steps (6 s at 20 ms a step alone, 17 s at the 60 ms measured beside the
suite's workers) to arrive; a signal after training ends meets Lightning's own SLURM handler, which
requeues the finished job without our checkpoint (a CI run once lost the race at 120 steps, ~2 s)."""


def submitted(directory: Path, train_args: str) -> tuple[str, Path]:
    """Submit ``python train.py TRAIN_ARGS`` as a requeueable SLURM job running in ``directory``.
    Returns (job id, its log file)."""
    directory.mkdir()
    log = directory / "job.out"
    script = directory / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={log}
#SBATCH --chdir={directory}
export WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
exec {sys.executable} {REPO / "train.py"} {train_args} trainer.max_steps={STEPS} tracker.enabled=false logger=csv \\
    trainer.log_every_n_steps=1 trainer.progress_every_n_steps=1 trainer.checkpoint_every_n_steps=1000
""")
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, env=dict(os.environ)
    ).stdout.strip()
    return job, log


@pytest.fixture(scope="module")
def warned_and_requeued(tmp_path_factory) -> dict[str, Path]:
    """A single run and a two-member ensemble, submitted together as requeueable SLURM jobs (one CPU
    each: the cluster's two run them side by side), each warned (SIGUSR1) at step 15; SLURM requeues
    them and the requeued jobs run to the end. Returns each one's directory, by name."""
    if not slurm_is_up():
        if os.environ.get("REQUIRE_SLURM"):
            pytest.fail("REQUIRE_SLURM is set but no SLURM cluster answers (sinfo)")
        pytest.skip('no SLURM cluster here: eval "$(.ci/start-local-slurm)" starts one (root, Debian)')
    root = tmp_path_factory.mktemp("slurm")
    jobs = {
        name: submitted(root / name, args)
        for name, args in (("single", ""), ("ensemble", "-m hydra/launcher=ensemble seed=0,1"))
    }
    states = {}
    try:
        for name, (job, log) in jobs.items():
            wait_for(
                lambda log=log: log.is_file() and "step 15/" in log.read_text(), 180, f"the {name} job to reach step 15"
            )
            subprocess.run(
                ["scancel", "-b", "--signal=USR1", job], check=True
            )  # what --signal=USR1@T sends before the time limit
        for name, (job, _) in jobs.items():
            wait_for(lambda job=job: job_field(job, "Restarts") == "1", 120, f"SLURM to requeue the {name} job")
            start_requeued_job_now(job)
        for name, (job, _) in jobs.items():
            states[name] = wait_for(
                lambda job=job: job_field(job, "JobState") in FINISHED and job_field(job, "JobState"),
                300,
                f"the requeued {name} job to finish",
            )
    finally:
        for job, _ in jobs.values():
            subprocess.run(["scancel", job], capture_output=True)
    for name, (job, log) in jobs.items():
        printed = log.read_text()
        assert states[name] == "COMPLETED", (
            f"the requeued {name} job ended {states[name]} ({job_field(job, 'Reason')}):\n{printed[-3000:]}"
        )
        assert job_field(job, "Restarts") == "1", printed[-3000:]
        assert "stopped by SIGUSR1 at step" in printed and f"SLURM job {job} requeued" in printed
        assert "SIGTERM received" not in printed  # SLURM's SIGTERM to the requeued attempt is not a new stop
    return {name: log.parent for name, (_, log) in jobs.items()}


def train_loss_steps(run_dir) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get("train/loss")]


def test_a_warned_slurm_job_requeues_and_resumes_its_run_in_place(warned_and_requeued):
    directory = warned_and_requeued["single"]
    printed = (directory / "job.out").read_text()
    (run_dir,) = [p.parent for p in directory.glob("outputs/*/*/checkpoints")]  # one run directory, continued
    assert f"resuming {run_dir}" in printed
    assert train_loss_steps(run_dir) == list(range(STEPS))  # every step once, across the two attempts
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == STEPS


def test_a_warned_slurm_ensemble_requeues_and_resumes_every_member_in_its_sweep_directory(warned_and_requeued):
    directory = warned_and_requeued["ensemble"]
    printed = (directory / "job.out").read_text()
    (sweep_dir,) = directory.glob("multirun/*/*")  # one sweep directory, continued
    assert f"resuming the ensemble in {sweep_dir}" in printed and "resuming 2 members at step" in printed
    for member in ("0", "1"):
        assert train_loss_steps(sweep_dir / member) == list(range(STEPS))
        checkpoint = torch.load(sweep_dir / member / "checkpoints" / "last.ckpt", weights_only=True)
        assert checkpoint["global_step"] == STEPS


def test_a_job_that_asks_to_be_requeued_is_and_its_restart_count_says_so(monkeypatch):
    """``requeue_this_job`` as a running job calls it: SLURM requeues the job, the job's restart count (which
    decides where ``scontrol requeue`` could not answer) goes from 0 to 1, and SLURM's SIGTERM to the
    requeued attempt is ignored from then on."""
    from runtime.slurm import requeue_this_job, restarts

    if not slurm_is_up():
        if os.environ.get("REQUIRE_SLURM"):
            pytest.fail("REQUIRE_SLURM is set but no SLURM cluster answers (sinfo)")
        pytest.skip('no SLURM cluster here: eval "$(.ci/start-local-slurm)" starts one (root, Debian)')
    sigterm = signal.getsignal(signal.SIGTERM)
    submit = ["sbatch", "--parsable", "--requeue", "--output=/dev/null", "--wrap", "sleep 300"]
    job = subprocess.run(submit, capture_output=True, text=True, check=True).stdout.strip()
    try:
        wait_for(lambda: job_field(job, "JobState") == "RUNNING", 180, "the job to start")
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
        assert restarts(job) == 0
        assert requeue_this_job() == (True, f"SLURM job {job} requeued: it will resume from the checkpoint")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # SLURM's SIGTERM to the leaving job
        assert restarts(job) == 1 and job_field(job, "Restarts") == "1"
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # this test process is not leaving
        subprocess.run(["scancel", job], capture_output=True)
