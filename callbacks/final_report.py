"""At the end of training: the run's report (figures, summary, validity table), drawn, logged and printed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L


class FinalReport(L.Callback):
    """At the end of fit: render the report, log its figures (unless ``figures`` is false), validity table
    and summary to W&B, print it. ``meanwhile``: work of the run's end to begin once the figures are
    being drawn (the explorer page), on the cores they leave."""

    def __init__(
        self, run_dir: Path, smoothing_window: int, figures: bool, meanwhile: Callable[[], None] | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.smoothing_window = smoothing_window
        self.figures = figures
        self.meanwhile = meanwhile

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            from records.disk import ReportUnwritten, disk_full
            from reports.publish import publish_report  # the plotting library (0.8 s) only at the end

            try:
                publish_report(
                    self.run_dir,
                    trainer.loggers,
                    trainer.global_step,
                    self.smoothing_window,
                    self.figures,
                    self.meanwhile,
                )
            except OSError as error:
                if disk_full(error) is None:
                    raise
                raise ReportUnwritten(f"the end-of-run report at step {trainer.global_step}") from error
