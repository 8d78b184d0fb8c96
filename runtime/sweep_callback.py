"""A Hydra callback: when a multirun ends, report the sweep as one result (``reports.sweep_report``),
log it to a W&B summary run of the sweep's group, and exit non-zero when a job did not finish (a
job's failure does not stop the others: train.py returns its exit code to Hydra instead of raising).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from records.layout import (
    EMERGENCE_FIGURE,
    SWEEP_ALIGNED_FIGURE,
    SWEEP_CURVES_FIGURE,
    SWEEP_INTERVENTIONS_FIGURE,
    SWEEP_MIDPOINTS_FIGURE,
    job_dirs,
)


class SweepEndReport(Callback):
    """At the end of a multirun: the sweep report, printed, logged to W&B, and a non-zero exit when a job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from reports.sweep_report import print_sweep_report, sweep_report  # matplotlib: only when needed

        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            report = sweep_report([sweep_dir], figures=config.figures)  # figures=false: as a run's end, none
        except FileNotFoundError as error:
            print(f"no sweep report: {error}", file=sys.stderr)
            return
        print_sweep_report(report)
        law = emergence_law(report)
        page = write_sweep_page(sweep_dir) if config.explorer else None
        if config.logger.wandb.enabled:
            log_to_wandb(config, report, law, page)
        if report.failed:
            sys.exit(f"error: {len(report.failed)} of {len(report.jobs)} jobs did not finish (see the report above)")


def emergence_law(report):
    """The emergence law of a sweep that varied a number (:mod:`reports.emergence`), printed and written
    beside the report; None for a sweep that varied none (a sweep of seeds alone, of intervention names)."""
    from reports.emergence import emergence_laws, numeric_variables, print_emergence, write_emergence

    if not numeric_variables(report.jobs):
        return None
    laws, notes = emergence_laws(report.jobs)
    files = write_emergence(laws, notes, report.directory, figure=report.drawn)
    print_emergence(laws, notes, files)
    return laws, files


def write_sweep_page(sweep_dir: Path) -> Path | None:
    """The sweep's ``explorer.html`` (:mod:`analysis.explorer_pages`): its members' curves, linking to their
    pages; its path, or None (said) where it could not be written."""
    from analysis.explorer_pages import write_sweep_page as write

    try:
        path, size, seconds = write(sweep_dir, job_dirs([sweep_dir]))
        print(
            f"explorer: {path} ({size / 1e6:.1f} MB, {seconds:.1f} s): the sweep's runs, each linking to its own page"
        )
        return path
    except Exception as error:  # the page only: the sweep's report is written
        print(
            f"explorer: not written ({type(error).__name__}: {error}); python -m analysis.explorer {sweep_dir}",
            file=sys.stderr,
        )
        return None


def log_to_wandb(config: DictConfig, report, law=None, page: Path | None = None) -> None:
    """The report's tables, figures, charts (:func:`reports.wandb_charts.sweep_plots`) and explorer ``page``
    (HTML media, :data:`records.wandb_run.PAGE_KEY`), in a W&B
    run named ``sweep report`` in the jobs' group (:mod:`records.wandb_run`), not through a Lightning
    logger: the launching process trains nothing and has not imported Lightning, which would add 5 s to
    every sweep's end."""
    import wandb

    from records.wandb_run import PAGE_KEY, log_row, open_run, report_run_options
    from reports.sweep_report import SEED_KEYS
    from reports.wandb_charts import sweep_plots
    from runtime.naming import wandb_naming

    run = open_run(
        report_run_options(
            config,
            report.directory,
            group=wandb_naming(config, [], str(config.hydra.sweep.dir)).group,
            name="sweep report",
            job_type="sweep_report",
        )
    )
    columns = list(dict.fromkeys(k for row in report.job_table for k in row))
    figures = {"loss_curves": SWEEP_CURVES_FIGURE, "midpoints": SWEEP_MIDPOINTS_FIGURE, "aligned": SWEEP_ALIGNED_FIGURE}
    tables = {}
    if report.intervened:
        figures["interventions"] = SWEEP_INTERVENTIONS_FIGURE
        rows = report.training_validity
        if rows:
            tables["sweep/training_validity"] = wandb.Table(
                columns=list(rows[0]), data=[[str(row.get(c, "")) for c in rows[0]] for row in rows]
            )
    if law is not None:
        from reports.emergence import verdict_rows

        laws, files = law
        rows = verdict_rows(laws)
        law_columns = list(dict.fromkeys(k for row in rows for k in row))
        tables["sweep/emergence"] = wandb.Table(
            columns=law_columns, data=[[str(row.get(c, "")) for c in law_columns] for row in rows]
        )
        figures["emergence_law"] = EMERGENCE_FIGURE  # beside the table's key, not over it
    if not report.drawn:  # a sweep run with figures=false: its tables and charts, no images
        figures = {}
    log_row(  # one row: the report has no step
        run,
        {
            "sweep/jobs": wandb.Table(
                columns=columns, data=[[str(row.get(c, "")) for c in columns] for row in report.job_table]
            ),
            **{f"sweep/{key}": wandb.Image(str(report.directory / name)) for key, name in figures.items()},
            **tables,
            **sweep_plots(report.jobs, [key for key in report.swept if key not in SEED_KEYS]),
            **({PAGE_KEY: wandb.Html(str(page), inject=False)} if page is not None else {}),
        },
    )
    run.finish(exit_code=1 if report.failed else 0)
