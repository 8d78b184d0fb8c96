"""A benchmark's ``--out FILE``: checked before any work, written with the benchmarks' mark.

Every ``python -m bench.NAME --out FILE`` writes one JSON object whose first key, ``"kind"``, names the
project (:data:`records.outputs.WRITTEN_BY`) and the benchmark, so that a later run may write over results a
benchmark wrote and is refused, in one line before it measures anything, a file no benchmark wrote (a run's
``summary.json``, a user's notes): :func:`records.outputs.foreign_out`, as the project's commands do.
"""

from __future__ import annotations

import json
from pathlib import Path

from records.outputs import WRITTEN_BY, foreign_out

MARK = f'"kind": "{WRITTEN_BY} bench.'
"""What every benchmark's results file holds in its first line after ``{``."""


def check_out(out: str | Path | None) -> None:
    """Exit (status 1, one line on stderr, nothing written) where ``out`` is a file no benchmark wrote,
    a directory, or in a directory that does not exist; return where it may be written."""
    if out is not None and (why := foreign_out(Path(out), MARK)):
        raise SystemExit(f"error: {why}")


def write_results(out: str | Path, bench: str, results: dict) -> None:
    """``results`` as JSON at ``out``, after ``"kind": "<WRITTEN_BY> bench.<bench>"``."""
    text = json.dumps({"kind": f"{WRITTEN_BY} bench.{bench}", **results}, indent=2, default=str)
    Path(out).write_text(text + "\n")
