"""A finished run's report handed to its loggers: the CSV flushed, the report rendered
(:func:`reports.run_report.render`), its figures, validity table, summary and comparison charts
logged to W&B, and printed. Apart from :mod:`reports.run_report` so that rendering a report (``python
-m reports.run_report``, the sweep report, the analyses' refusals) never imports Lightning."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger

from records.wandb_log import SectionedWandbLogger
from reports import validity_table as validity
from reports.run_report import RunReport, print_report, render
from reports.wandb_charts import log_charts


def publish_report(
    run_dir: Path, loggers: list, step: int, window: int, figures: bool, meanwhile: Callable[[], None] | None = None
) -> RunReport | None:
    """Flush the CSV, render the report of ``run_dir`` (its figures only with ``figures``; ``meanwhile``
    begun once they are being drawn), log its figures, validity table,
    summary and comparison charts (:mod:`reports.wandb_charts`) to every W&B logger at ``step``, and print
    it (None, said why, when there is nothing to draw)."""
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            logger.save()  # flush rows still buffered
    try:
        report = render(run_dir, window, figures, meanwhile)
    except (FileNotFoundError, ValueError) as error:
        print(f"no figure: {error}")
        return None
    for logger in loggers:
        if isinstance(logger, SectionedWandbLogger):
            if report.figure is not None:
                logger.log_image(key="images/phase_change", images=[str(report.figure)], step=step)
            if report.composition_figure is not None:
                logger.log_image(key="images/composition_final", images=[str(report.composition_figure)], step=step)
            if report.strategies_figure is not None:
                logger.log_image(key="images/strategies", images=[str(report.strategies_figure)], step=step)
            if report.heads_figure is not None:
                logger.log_image(key="images/heads", images=[str(report.heads_figure)], step=step)
            if report.validity_rows:
                if report.validity_figure is not None:
                    logger.log_image(key="images/validity", images=[str(report.validity_figure)], step=step)
                logger.log_table(
                    key="validity/table",
                    columns=validity.COLUMNS,
                    data=validity.table_as_lists(report.validity_rows),
                    step=step,
                )
            logger.log_summary(report.summary)
    log_charts(loggers, report.charts, step)
    print_report(report)
    return report
