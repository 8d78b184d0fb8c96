"""Progress as plain lines, for logs that are not a terminal (a SLURM job's output, `> file`),
where a progress bar becomes thousands of carriage-return redraws on one line."""

from __future__ import annotations

import time

import lightning as L


class ProgressLines(L.Callback):
    """Print ``step N/M  loss L  (T ms/step)`` every ``every_n_steps`` optimizer steps, flushed."""

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = every_n_steps
        self._last: tuple[int, float] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = (trainer.global_step, time.perf_counter())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or not trainer.is_global_zero or self._last is None or step == self._last[0]:
            return
        last_step, last_time = self._last
        now = time.perf_counter()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        print(
            f"step {step}/{trainer.max_steps}  loss {float(loss):.4f}  ({1000 * (now - last_time) / (step - last_step):.1f} ms/step)",
            flush=True,
        )
        self._last = (step, now)
