"""A full disk: telling it from other failures and clearing the partial files a run was writing
(checkpoints replaced whole or not at all: records/checkpoint_writer.py). Imports no Lightning: a run's
start-up reads it before its config is checked."""

from __future__ import annotations

import errno
import traceback
from pathlib import Path

NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
PROJECT = Path(__file__).resolve().parent.parent  # the project's folder, left out of a path named
OWN_FOLDERS = ("checkpoints", "trajectory", "tensors", "csv")  # where the run writes (wandb/ is W&B's)
WRITING_SUFFIX = ".writing"  # the project's partial files: ".NAME.writing" beside NAME, renamed over it when whole


def exception_chain(error: BaseException | None):
    """``error`` and what it was raised from or during, in turn."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def disk_full(error: BaseException | None) -> OSError | None:
    """The "no space left on device" (or over quota) error behind ``error``, following what it was raised
    from or during; None when the failure is something else."""
    for raised in exception_chain(error):
        if isinstance(raised, OSError) and raised.errno in NO_ROOM:
            return raised
        if "No space left on device" in str(raised):  # safetensors' Rust error: its message only
            return OSError(errno.ENOSPC, str(raised))
    return None


def what_failed(error: OSError, run_dir: Path) -> str:
    """The file a full disk stopped, relative to the run where it is inside it ("a file" when unnamed)."""
    named = error.filename2 or error.filename
    if not named:  # where it was writing, at least: the innermost frame, its package's path
        frames = traceback.extract_tb(error.__traceback__)
        if not frames:
            return "a file"
        where = frames[-1].filename.rpartition("site-packages/")[2].removeprefix(str(PROJECT) + "/")
        return f"a file ({where}, {frames[-1].name})"
    path = Path(named)
    for partial in (WRITING_SUFFIX, ".tmp"):  # the file being written, by the name it was to have
        if path.name.endswith(partial):
            path = path.with_name(path.name[: -len(partial)].removeprefix("." if partial == WRITING_SUFFIX else ""))
    try:
        return str(path.resolve().relative_to(Path(run_dir).resolve()))
    except ValueError:
        return str(path)


def make_room(run_dir: Path, full: OSError | None = None) -> list[Path]:
    """Delete the partial files a run was writing when the disk filled (``.NAME.writing`` and ``NAME.tmp``
    in the run's own folders, the status record's among them, and the destination of the copy that ``full``
    stopped; never a finished file), so that the status record can be written; returns what went."""
    run_dir = Path(run_dir)
    folders = [run_dir, *(run_dir / folder for folder in OWN_FOLDERS)]
    partial = [
        path for folder in folders for pattern in (f".*{WRITING_SUFFIX}", "*.tmp") for path in folder.glob(pattern)
    ]
    if full is not None and full.filename2 and Path(full.filename2).resolve().is_relative_to(run_dir.resolve()):
        partial.append(Path(full.filename2))  # a copy's destination, cut short (W&B's copy of the page)
    for path in partial:
        path.unlink(missing_ok=True)
    return partial


class ReportUnwritten(Exception):
    """The end-of-run report stopped by a full disk: training finished, and its records are kept."""
