"""The W&B logger of every run, analysis and ensemble member: Lightning's ``WandbLogger`` given the W&B run
that :mod:`records.wandb_run` opened (its public ``experiment`` argument), each tracker key logged under its
section (:mod:`records.wandb_sections`, which names them without importing Lightning)."""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig

from records.wandb_run import open_run, report_run_options
from records.wandb_sections import STEP_KEY, summary_of, wandb_key


class SectionedWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` on an open W&B ``run`` (``save_dir``: where it keeps its files), that logs
    each numeric tracker key under its section (:func:`wandb_key`) and defines its step axis and summary the
    first time it appears. The W&B run of a training run and of an analysis alike: values go through
    :meth:`log_metrics` (with their step), figures through ``log_image``, tables through ``log_table``,
    end-of-run values through :meth:`log_summary`, and :meth:`finish` ends it."""

    def __init__(self, run, save_dir: str) -> None:
        super().__init__(experiment=run, save_dir=save_dir)
        run.define_metric(STEP_KEY)  # the step axes Lightning defines on a run it opens itself
        run.define_metric("*", step_metric=STEP_KEY, step_sync=True)
        self._defined: set[str] = set()

    def log_metrics(self, metrics: Mapping[str, object], step: int | None = None) -> None:
        renamed = {}
        for key, value in metrics.items():
            new = wandb_key(key) if isinstance(value, (int, float)) else key
            if new != key and new not in self._defined:
                if (summary := summary_of(key)) is not None:  # the rest take the run's "*" step axis
                    self.experiment.define_metric(new, step_metric=STEP_KEY, summary=summary)
                self._defined.add(new)
            renamed[new] = value
        super().log_metrics(renamed, step)

    def log_summary(self, values: Mapping[str, object]) -> None:
        """Values of the run as a whole (W&B's summary: a runs table's columns)."""
        self.experiment.summary.update(dict(values))

    def finish(self, exit_code: int = 0) -> None:
        """End the W&B run (a training run's is ended by ``runtime.job``, which knows how it ended)."""
        self.experiment.finish(exit_code=exit_code)


def opened_logger(options: Mapping[str, object]) -> SectionedWandbLogger:
    """A logger on a W&B run opened now with ``wandb.init`` ``options`` (:mod:`records.wandb_run`)."""
    return SectionedWandbLogger(open_run(options), str(options["dir"]))


def analysis_logger(cfg: DictConfig, save_dir, **run) -> SectionedWandbLogger:
    """An analysis's W&B run in ``save_dir`` (:func:`records.wandb_run.report_run_options`; ``run``: its name,
    group, job type, ...), opened now, as its logger."""
    return opened_logger(report_run_options(cfg, save_dir, **run))
