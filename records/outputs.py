"""What a command may write over: a new file, its own default, or a file of its own kind, told by the
mark every command leaves in what it writes (an HTML page's generator, a PNG's Software, a JSON's
``kind``). Anything else, a run's ``summary.json`` above all, is never written over."""

from __future__ import annotations

from pathlib import Path

WRITTEN_BY = "induction-composition-tracker"
"""The mark a command leaves in what it writes (an HTML page's generator, a PNG's Software, a JSON's
``kind``), so that an existing file can be told from one it did not write."""


def foreign_out(out: Path, mark: str, default: Path | None = None) -> str | None:
    """Why a command must not write ``out`` (one line), None where it may: a new file in an existing
    directory, the command's ``default`` path, or a file of its own kind (``mark`` within its first 4 KB).
    Anything else (a run's ``summary.json``, a user's file, a directory) is never written over."""
    out = Path(out)
    if default is not None and out.resolve() == Path(default).resolve():
        return None
    if not out.exists():
        return None if out.parent.is_dir() else f"--out {out}: no directory {out.parent}"
    if out.is_dir():
        return f"--out {out} is a directory: name a new file"
    with open(out, "rb") as handle:
        if mark.encode() in handle.read(4096):
            return None
    return f"--out {out} exists and this command did not write it: name a new file (nothing written)"
