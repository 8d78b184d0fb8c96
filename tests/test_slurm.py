"""A real SLURM job, warned before its time limit (SIGUSR1), requeues itself and finishes its run in place.

Needs a SLURM cluster (``sinfo`` answers): CI starts a single-node one (``.ci/start-local-slurm``) and
sets ``REQUIRE_SLURM=1``, so there the test fails rather than skips; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def slurm_is_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    result = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return result.returncode == 0 and any(state in result.stdout for state in ("idle", "mix", "alloc"))


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def job_field(job: str, field: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return next((word.split("=", 1)[1] for word in shown.split() if word.startswith(f"{field}=")), "")


def start_requeued_job_now(job: str) -> None:
    """Let a requeued job start now rather than after SLURM's two-minute hold, but not within the
    second of the requeue: slurmd revokes the first launch's credential with a one-second timestamp
    and refuses (the job then FAILS) a relaunch whose credential is as old."""
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)


def test_a_warned_slurm_job_requeues_and_resumes_its_run_in_place(tmp_path):
    if not slurm_is_up():
        if os.environ.get("REQUIRE_SLURM"):
            pytest.fail("REQUIRE_SLURM is set but no SLURM cluster answers (sinfo)")
        pytest.skip('no SLURM cluster here: eval "$(.ci/start-local-slurm)" starts one (root, Debian)')
    log = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={log}
#SBATCH --chdir={tmp_path}
export WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1
exec {sys.executable} {REPO / "train.py"} trainer.max_steps=120 tracker.enabled=false logger=csv trainer.log_every_n_steps=1 \\
    trainer.progress_every_n_steps=1 trainer.checkpoint_every_n_steps=1000
""")
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, env=dict(os.environ)
    ).stdout.strip()
    try:
        wait_for(lambda: log.is_file() and "step 15/" in log.read_text(), 180, "the job to reach step 15")
        subprocess.run(
            ["scancel", "-b", "--signal=USR1", job], check=True
        )  # what --signal=USR1@T sends before the time limit
        wait_for(lambda: job_field(job, "Restarts") == "1", 120, "SLURM to requeue the job")
        start_requeued_job_now(job)
        state = wait_for(
            lambda: job_field(job, "JobState") in FINISHED and job_field(job, "JobState"),
            300,
            "the requeued job to finish",
        )
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    printed = log.read_text()
    assert state == "COMPLETED", f"the requeued job ended {state} ({job_field(job, 'Reason')}):\n{printed[-3000:]}"
    assert job_field(job, "Restarts") == "1", printed[-3000:]
    assert "stopped by SIGUSR1 at step" in printed and f"SLURM job {job} requeued" in printed
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/*/checkpoints")]  # one run directory, continued
    assert f"resuming {run_dir}" in printed
    with open(run_dir / "csv" / "metrics.csv", newline="") as file:
        steps = [int(row["step"]) for row in csv.DictReader(file) if row.get("train/loss")]
    assert steps == list(range(120))  # every step once, across the two attempts
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 120
