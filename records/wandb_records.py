"""Read a W&B offline run file (``run-*.wandb``) back through W&B's own public reader: the terminal
viewer's ``wandb leet inspect --json``, which prints each record of the file as one JSON object.
The sweep report reads runs known only by their W&B files with it; the tests check with it what a
run logged.

Each call reads the file once per process and keeps its records (keyed by the file's path, size and
modification time), so asking one file for its history, summary and config costs one read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path


class WandbFileError(RuntimeError):
    """A W&B run file W&B's reader refuses (the message is its own, in one line)."""


def records(path: Path) -> list[dict]:
    """Every record of the run file as W&B's reader prints it: ``{"type": ..., TYPE: {...}}``."""
    path = Path(path)
    stat = path.stat()
    return _records(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=64)
def _records(path: str, size: int, mtime_ns: int) -> list[dict]:
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split())[-300:] or f"exit status {result.returncode}"
        raise WandbFileError(f"{path} is not a readable W&B run file: {reason}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _of_type(path: Path, kind: str) -> list[dict]:
    return [record[kind] for record in records(path) if record.get("type") == kind]


def _keys(items: dict) -> dict[str, object]:
    """W&B's reader names a nested value ``parent.child`` (an image's ``.width``, a table's ``.sha256``);
    here it is ``parent/child``, as the run's own keys are."""
    return {key.replace(".", "/"): value for key, value in items.items()}


def history(path: Path) -> list[dict[str, object]]:
    """Every ``wandb.log`` row of the run, keys to values."""
    return [_keys(row.get("item", {})) for row in _of_type(path, "history")]


def config(path: Path) -> dict[str, object]:
    """The run's config, merged over all its config records (nested sections as nested dicts)."""
    merged: dict[str, object] = {}
    for run in _of_type(path, "run"):
        merged.update(_keys(run.get("config", {}).get("update", {})))
    for update in _of_type(path, "config"):
        merged.update(_keys(update.get("update", {})))
    return merged


def summary(path: Path) -> dict[str, object]:
    """The run's final summary (the last value written for each key)."""
    merged: dict[str, object] = {}
    for update in _of_type(path, "summary"):
        merged.update(_keys(update.get("update", {})))
    return merged


def exit_code(path: Path) -> int | None:
    """The exit code the run finished with (0: marked successful), or None if it never finished."""
    codes = [int(record.get("exit_code", 0)) for record in _of_type(path, "exit")]
    return codes[-1] if codes else None


RUN_FIELDS = {"run_id": "", "display_name": "", "run_group": "", "job_type": "", "tags": ()}
"""The run record's fields the readers ask for, with the value W&B leaves out of its record when empty."""


def run(path: Path) -> dict[str, object]:
    """The run record: ``run_id``, ``display_name``, ``run_group``, ``job_type``, ``tags`` (and the rest W&B
    keeps); :class:`WandbFileError` when the file has none (a run file cut off before its first record)."""
    record = next(iter(_of_type(path, "run")), None)
    if record is None:
        raise WandbFileError(f"{path}: no run record (not a W&B run file, or cut off before its first record)")
    return {**RUN_FIELDS, **record}


def run_id(path: Path) -> str:
    """The W&B run id the file records."""
    return str(run(path)["run_id"])
