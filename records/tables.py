"""The one writer of every table a run, an analysis or a sweep writes (CSV, replaced atomically)."""

from __future__ import annotations

import csv
import os
from pathlib import Path


def write_rows(path: Path, rows: list[dict], columns: list[str] | None = None) -> None:
    """``rows`` as a CSV table at ``path``, atomically (a reader sees the old table or the new one);
    ``columns``: the header, by default every key of the rows in the order they first appear."""
    header = columns if columns is not None else list(dict.fromkeys(key for row in rows for key in row))
    temporary = Path(path).with_suffix(".csv.tmp")
    with open(temporary, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(temporary, path)
