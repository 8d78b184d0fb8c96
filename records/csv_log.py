"""A CSV logger that continues a resumed run's ``metrics.csv`` (every other table is written by
:mod:`records.tables`)."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger

from records.layout import CSV_DIR, CSV_RELATIVE_PATH


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger(save_dir, name="csv", version="")`` that, when ``resume_step`` is given, keeps the run's
    existing ``csv/metrics.csv`` up to (not including) ``resume_step``, so each step is in the file exactly
    once (the resumed run logs ``resume_step`` itself again).

    Lightning's writer starts every file afresh (it removes an existing ``metrics.csv`` when it is made) and
    offers no switch to continue one: the kept rows are read first, then handed back to the new writer
    through its public ``log_metrics`` and written at once (``save``), as they were, string for string.
    Between the removal and that write (one call) the rows are in memory only."""

    def __init__(self, save_dir: str | Path, resume_step: int | None = None) -> None:
        super().__init__(save_dir=str(save_dir), name=CSV_DIR, version="")
        self.resume_step = resume_step
        self.dropped_rows = self.cut_rows = 0
        self.kept: list[dict[str, str]] | None = None
        metrics = Path(self.log_dir) / CSV_RELATIVE_PATH.name
        if resume_step is not None and metrics.is_file():
            with open(metrics, newline="") as file:
                read = list(csv.DictReader(file))
            rows = [row for row in read if None not in row.values() and None not in row]  # a row cut short (a full
            self.cut_rows = len(read) - len(rows)  # disk, a kill) is left out: its step is trained and logged again
            self.kept = [row for row in rows if row.get("step", "") == "" or int(float(row["step"])) < resume_step]
            self.dropped_rows = len(rows) - len(self.kept)

    @property
    def experiment(self):
        if self.kept is None:
            return super().experiment
        kept, self.kept = self.kept, None
        with warnings.catch_warnings():  # "... will be deleted when the new ones are saved": they are written back
            warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
            writer = super().experiment
        for row in kept:
            step = row.pop("step", "")
            writer.log_metrics(row, int(float(step)) if step != "" else None)
        writer.save()
        return writer
