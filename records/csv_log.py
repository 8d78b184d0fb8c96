"""A CSV logger that continues a resumed run's ``metrics.csv`` instead of deleting it, and the one
writer of every other table a run, an analysis or a sweep writes (:func:`write_rows`)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from records.layout import CSV_DIR


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


def truncate_rows(path: Path, first_dropped_step: int) -> tuple[list[str], int]:
    """Drop the rows of the CSV at ``path`` whose ``step`` is ``>= first_dropped_step``, in place
    (written to a temporary file, then renamed over it). Returns (the header, rows dropped)."""
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    kept = [row for row in rows if row.get("step", "") == "" or int(float(row["step"])) < first_dropped_step]
    write_rows(path, kept, header)
    return header, len(rows) - len(kept)


class _ContinuingWriter(ExperimentWriter):
    """Lightning's writer, minus the deletion of an existing ``metrics.csv``: new rows are appended
    under its header (the header grows, as Lightning's does, when new keys appear)."""

    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as file:
                self.metrics_keys = sorted(next(csv.reader(file), []))


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger(save_dir, name="csv", version="")`` that, when ``resume_step`` is given, keeps the
    run's existing ``csv/metrics.csv`` up to (not including) ``resume_step`` and appends to it, so each
    step is in the file exactly once (the resumed run logs ``resume_step`` itself again)."""

    def __init__(self, save_dir: str | Path, resume_step: int | None = None) -> None:
        super().__init__(save_dir=str(save_dir), name=CSV_DIR, version="")
        self.resume_step = resume_step
        self.dropped_rows = 0

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and self.resume_step is not None:
            metrics = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
            if metrics.is_file():
                _, self.dropped_rows = truncate_rows(metrics, self.resume_step)
            os.makedirs(self.log_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return super().experiment
