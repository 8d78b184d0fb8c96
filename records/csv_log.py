"""A CSV logger that continues a resumed run's ``metrics.csv`` instead of deleting it (every other
table is written by :mod:`records.tables`)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from records.layout import CSV_DIR
from records.tables import truncate_rows


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
