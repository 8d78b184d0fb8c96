"""Progress on a terminal (a bar) and in logs that are not one (a SLURM job's output, `> file`: plain
lines, where a bar becomes thousands of carriage-return redraws on one line), both showing the loss
as :class:`~callbacks.divergence.DivergenceGuard` read it: neither reads it from the device again."""

from __future__ import annotations

import importlib.util
import time

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from callbacks.divergence import DivergenceGuard


class ProgressLines(L.Callback):
    """Print ``step N/M  loss L  (T ms/step)`` every ``every_n_steps`` optimizer steps, flushed."""

    def __init__(self, every_n_steps: int = 100, guard: DivergenceGuard | None = None) -> None:
        self.every_n_steps = every_n_steps
        self.guard = guard
        self._last: tuple[int, float] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = (trainer.global_step, time.perf_counter())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not trainer.is_global_zero or self._last is None or step == self._last[0]:
            return
        last_step, last_time = self._last
        now = time.perf_counter()
        loss = self.guard.loss if self.guard is not None else None
        if loss is None:  # no guard: read it here
            loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
        print(
            f"step {step}/{trainer.max_steps}  loss {loss:.4f}  ({1000 * (now - last_time) / (step - last_step):.1f} ms/step)",
            flush=True,
        )
        self._last = (step, now)


class GuardedLoss:
    """A Lightning progress bar that shows the loss the guard read at the last step (``train/loss``
    is logged without ``prog_bar``: the bar would read it from the device at every step)."""

    def __init__(self, guard: DivergenceGuard) -> None:
        super().__init__()
        self.guard = guard

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        if self.guard.loss is not None:
            metrics["loss"] = f"{self.guard.loss:.4f}"
        return metrics


class RichLossBar(GuardedLoss, RichProgressBar):
    """Lightning's default bar where ``rich`` is installed, with the loss."""


class TQDMLossBar(GuardedLoss, TQDMProgressBar):
    """Lightning's bar without ``rich``, with the loss."""


def loss_bar(guard: DivergenceGuard) -> L.Callback:
    """The bar Lightning would choose (rich where it is installed), showing the guard's loss."""
    return (RichLossBar if importlib.util.find_spec("rich") else TQDMLossBar)(guard)
