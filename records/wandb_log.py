"""The W&B logger of every run, analysis and sweep report: each tracker key logged under its section
(:mod:`records.wandb_sections`, which names them without importing Lightning)."""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import WandbLogger

from records.wandb_lean import lean_wandb
from records.wandb_sections import STEP_KEY, summary_of, wandb_key


class SectionedWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` that logs each numeric tracker key under its section
    (:func:`wandb_key`) and defines its step axis and summary the first time it appears; without
    the ``anonymous=None`` Lightning always passes to ``wandb.init``. The W&B run of a training
    run and of an analysis alike (an analysis's opened by ``conf.build.wandb_logger``): values go
    through :meth:`log_metrics` (with their step), figures through ``log_image``, tables through
    ``log_table``, end-of-run values through :meth:`log_summary`, and :meth:`finish` ends it."""

    def __init__(self, opening=None, **options) -> None:
        """``options``: ``WandbLogger``'s (``wandb.init`` runs when the run is first used); or ``opening``,
        a ``conf.wandb_run.WandbOpening`` already opening the run on a thread of its own, which imports
        W&B and makes it lean (:func:`lean_wandb`) itself: until the run is open no other thread may import
        W&B, whose modules import each other, and a second thread importing them at the same time can be
        handed one half-initialised (``ImportError: ... partially initialized module 'wandb.util'``)."""
        if opening is not None:
            o = opening.options
            options = dict(project=o["project"], name=o["name"], id=o["id"], save_dir=o["dir"])
        super().__init__(**options)
        if opening is None:
            lean_wandb()
        self._opening = opening
        self._defined: set[str] = set()
        if self._wandb_init.get("anonymous") is None:  # the one private field: Lightning offers no way to leave it out
            self._wandb_init.pop("anonymous", None)  # wandb 0.31 warns that it "has no effect" whenever it is given

    @property
    def experiment(self):
        """The W&B run: the one being opened, once it is open (with the step axes Lightning's own
        ``wandb.init`` path defines), else Lightning's."""
        if self._experiment is None and self._opening is not None:
            run, self._opening = self._opening.run(), None
            run.define_metric("trainer/global_step")
            run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
            self._experiment = run
        return super().experiment

    def log_metrics(self, metrics: Mapping[str, object], step: int | None = None) -> None:
        renamed = {}
        for key, value in metrics.items():
            new = wandb_key(key) if isinstance(value, (int, float)) else key
            if new != key and new not in self._defined:
                if (summary := summary_of(key)) is not None:  # the rest take the run's "*" step axis (experiment)
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
