"""``RUN_DIR/status.json``: whether a run is running, finished, failed or preempted, and why.

Written by train.py when a run starts and when it ends (atomically: a reader never sees half a
file). A sweep's report reads it to mark each job; a re-run sweep reads it to skip finished jobs
and resume interrupted ones. A run killed outright (SIGKILL, a lost node) stays ``running``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

from records.layout import STATUS_FILE

FINISHED, RUNNING, FAILED, PREEMPTED = "finished", "running", "failed", "preempted"

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""The signals that end a run as ``preempted``, checkpointed first: SLURM's, ``timeout``'s and
Kubernetes' SIGTERM, Ctrl-C, and the warnings ahead of a time limit (SLURM's SIGUSR1 with
``sbatch --signal=USR1@90``, submitit's SIGUSR2)."""


def write_status(
    run_dir: Path, status: str, exit_code: int = 0, step: int | None = None, error: str | None = None
) -> None:
    """Write ``status.json`` atomically (a temporary file renamed over it). On a full disk, where even its
    temporary file finds no room, it is rewritten in place instead: the record that says the disk filled
    must land, and the old record's own room is enough for it."""
    record = json.dumps({"status": status, "exit_code": exit_code, "step": step, "error": error}, indent=1) + "\n"
    path = Path(run_dir) / STATUS_FILE
    temporary = path.with_suffix(".json.tmp")
    try:
        temporary.write_text(record)
        os.replace(temporary, path)
    except OSError as full:
        temporary.unlink(missing_ok=True)
        if full.errno not in (errno.ENOSPC, errno.EDQUOT) or not path.is_file():
            raise
        path.write_text(record)


def read_status(run_dir: Path) -> dict | None:
    """The run's status record, or None when it has none (not a run, or one from before status files)."""
    path = Path(run_dir) / STATUS_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
