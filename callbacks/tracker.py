"""The composition tracker: every N optimizer steps, measure the model and log to every logger."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import WandbLogger

from callbacks.keys import snapshot_metrics
from callbacks.plots import composition_heatmaps, figure_to_rgb
from data.probe import ProbeBatch
from metrics.snapshot import Snapshot, take_snapshot


class CompositionTracker(L.Callback):
    """Logs composition, head scores and loss views on the probe batch every ``every_n_steps``.

    Runs on global rank 0 only, under ``no_grad``, restoring the model's train/eval mode; it
    draws no random numbers, so training is identical with and without it. Measures at step 0
    (before the first update) and after every ``every_n_steps``-th optimizer step; at every
    ``ablation_every_n_steps``-th step (0: never) also runs the K-only path ablation of every pair
    and logs how each measure agrees with it.
    """

    def __init__(
        self,
        probe: ProbeBatch,
        every_n_steps: int = 10,
        image_every_n_steps: int = 250,
        measures: tuple[str, ...] = ("frobenius",),
        baseline_samples: int = 2000,
        ablation_every_n_steps: int = 0,
    ) -> None:
        self.probe = probe
        self.every_n_steps = every_n_steps
        self.image_every_n_steps = image_every_n_steps
        self.ablation_every_n_steps = ablation_every_n_steps
        self.measures = measures
        self.baseline_samples = baseline_samples
        self.last_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.maybe_measure(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.maybe_measure(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.maybe_measure(trainer, pl_module, force=True)  # the final weights, whatever max_steps is

    def maybe_measure(self, trainer: L.Trainer, pl_module: L.LightningModule, force: bool = False) -> None:
        step = trainer.global_step
        force = force or 0 < trainer.max_steps <= step  # the last step: measure everything, images too
        due = force or step % self.every_n_steps == 0
        if not due or step == self.last_step or not trainer.is_global_zero:
            return  # gradient accumulation calls us several times per optimizer step
        self.last_step = step
        every = self.ablation_every_n_steps
        ablate = bool(every) and (step % every == 0 or force)
        snap = take_snapshot(pl_module.model, self.probe, self.measures, self.baseline_samples, ablate=ablate)
        metrics = snapshot_metrics(snap)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if self.image_every_n_steps and (step % self.image_every_n_steps == 0 or force):
            self.log_heatmaps(trainer, snap, step)

    def log_heatmaps(self, trainer: L.Trainer, snap: Snapshot, step: int) -> None:
        wandb_loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
        if not wandb_loggers:
            return  # rendering costs time; only W&B shows images
        for measure in self.measures:
            scores = {kind: snap.minus_baseline(measure, kind).numpy() for kind in snap.composition[measure]}
            rgb = figure_to_rgb(composition_heatmaps(scores, f"{measure} composition minus baseline, step {step}"))
            for logger in wandb_loggers:
                logger.log_image(key=f"images/composition/{measure}", images=[rgb], step=step)
