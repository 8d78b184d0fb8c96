"""SLURM: requeue a preempted job, and let the requeued job find the run it must continue.

``sbatch --requeue --signal=USR1@90 ...`` (or ``scancel -b --signal=USR1 JOB``): train.py checkpoints
the step in progress, asks SLURM to requeue the job (when the job allows requeueing) and exits; SLURM
starts the same batch script again with the same job id and ``SLURM_RESTART_COUNT`` >= 1, and
train.py resumes, in place, the run directory it recorded for that job id.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

from records.layout import CHECKPOINTS, LAST_CHECKPOINT, SLURM_RUNS


def slurm_job_key() -> str | None:
    """This SLURM job's id (``ARRAYJOB_TASK`` for an array task), or None outside SLURM."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}"
    return os.environ.get("SLURM_JOB_ID")


def remember_slurm_run(run_dir: Path) -> None:
    """Record which run directory this SLURM job writes, so that the job, once requeued, resumes it."""
    key = slurm_job_key()
    if key is not None:
        SLURM_RUNS.mkdir(parents=True, exist_ok=True)
        (SLURM_RUNS / key).write_text(str(Path(run_dir).resolve()) + "\n")


def requeued_slurm_run() -> Path | None:
    """The run directory this SLURM job wrote before it was requeued (``SLURM_RESTART_COUNT`` >= 1)
    when that directory has a checkpoint to resume from; else None."""
    key = slurm_job_key()
    if key is None or restart_count() < 1:
        return None
    record = SLURM_RUNS / key
    if not record.is_file():
        return None
    run_dir = Path(record.read_text().strip())
    return run_dir if (run_dir / CHECKPOINTS / LAST_CHECKPOINT).is_file() else None


def requeue_this_job() -> tuple[bool, str | None]:
    """Ask SLURM to requeue this job, when there is one and it may be requeued (``Requeue=1``).
    Returns (whether it was requeued, what happened for the console; None outside SLURM).

    SLURM ends the job's attempt as it requeues it (SIGTERM to every process of the job): this process,
    which leaves next, ignores SIGTERM from here on, and so does ``scontrol`` (an ignored signal stays
    ignored across ``exec``), which then answers rather than being cut off."""
    key = slurm_job_key()
    if key is None:
        return False, None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        shown = subprocess.run(["scontrol", "show", "job", key], capture_output=True, text=True, timeout=30)
        if "Requeue=1" not in shown.stdout:
            return False, f"SLURM job {key} does not allow requeueing (sbatch --requeue): not requeued"
        done = subprocess.run(["scontrol", "requeue", key], capture_output=True, text=True, timeout=30)
        # where scontrol could not answer all the same (a signal other than SIGTERM, say), the job's
        # restart count says what happened
        requeued = done.returncode == 0 or restarts(key) > restart_count()
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"SLURM job {key} not requeued: {error}"
    if not requeued and done.returncode < 0:
        return False, (
            f"SLURM job {key}: scontrol requeue was ended by signal {-done.returncode} before it answered;"
            f" `scontrol show job {key}` says whether the job was requeued"
        )
    if not requeued:
        return False, f"SLURM job {key} not requeued: {(done.stderr or done.stdout).strip()}"
    return True, f"SLURM job {key} requeued: it will resume from the checkpoint"


def restart_count() -> int:
    """How many times SLURM has requeued this job so far (``SLURM_RESTART_COUNT``; 0 for its first attempt)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def restarts(key: str) -> int:
    """The job's restart count as SLURM shows it now (``Restarts=`` of ``scontrol show job``); -1 if unknown."""
    shown = subprocess.run(["scontrol", "show", "job", key], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"\bRestarts=(\d+)", shown)
    return int(found.group(1)) if found else -1


def remember_slurm_sweep(sweep_dir: Path) -> None:
    """Record which sweep directory this SLURM job's ensemble writes, so that the job, once requeued, resumes it."""
    key = slurm_job_key()
    if key is not None:
        SLURM_RUNS.mkdir(parents=True, exist_ok=True)
        (SLURM_RUNS / f"{key}.sweep").write_text(str(Path(sweep_dir).resolve()) + "\n")


def requeued_slurm_sweep() -> Path | None:
    """The sweep directory this SLURM job's ensemble wrote before it was requeued; else None."""
    key = slurm_job_key()
    if key is None or restart_count() < 1:
        return None
    record = SLURM_RUNS / f"{key}.sweep"
    return Path(record.read_text().strip()) if record.is_file() else None
