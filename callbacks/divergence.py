"""Stop a run whose loss or weights stop being finite, before anything is measured or saved at that step."""

from __future__ import annotations

import lightning as L
import torch


class TrainingDiverged(RuntimeError):
    """Training produced a non-finite loss or non-finite weights; the message names the step."""


class DivergenceGuard(L.Callback):
    """After every optimizer step: the loss and every parameter must be finite, else raise
    :class:`TrainingDiverged`. Put it first among the callbacks: Lightning runs checkpointing last,
    so no checkpoint of the diverged weights is written, and the tracker never measures them."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss_finite = loss is None or bool(torch.isfinite(loss).all())
        weights_finite = bool(torch.stack([p.detach().isfinite().all() for p in pl_module.parameters()]).all())
        if not (loss_finite and weights_finite):
            what = f"loss {float(loss):g}" if not loss_finite else "non-finite weights"
            raise TrainingDiverged(f"training diverged at step {trainer.global_step}: {what}")
