"""Stop a run whose loss or weights stop being finite, before anything is measured or saved at that step."""

from __future__ import annotations

import math
from collections.abc import Iterable

import lightning as L
import torch
from torch import Tensor


class TrainingDiverged(RuntimeError):
    """Training produced a non-finite loss or non-finite weights; the message names the step."""


def largest_magnitude(tensors: Iterable[Tensor]) -> Tensor:
    """``max |x|`` over every element of ``tensors``, a 0-dim float tensor on their device, without a
    host sync: ``torch.nn.utils.get_total_norm`` of order ∞ (a fused multi-tensor kernel per device
    and dtype where torch has one, as on CUDA). It is finite exactly when every element is: ∞ stays
    ∞ and NaN propagates through the max."""
    return torch.nn.utils.get_total_norm([t.detach() for t in tensors], norm_type=math.inf)


class DivergenceGuard(L.Callback):
    """After every optimizer step: the loss and every parameter must be finite, else raise
    :class:`TrainingDiverged`. Put it first among the callbacks: Lightning runs checkpointing last,
    so no checkpoint of the diverged weights is written, and the tracker never measures them.

    One host sync a step: the loss and the weights' largest magnitude are read together, and the
    loss is kept (``loss``) for the progress bar and lines, which would otherwise each read it again."""

    def __init__(self) -> None:
        self.loss: float | None = None  # the last step's loss, as read here

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        weights = largest_magnitude(pl_module.parameters()).float()
        read = weights[None] if loss is None else torch.stack([weights, loss.detach().float().reshape(())])
        values = read.tolist()
        self.loss = None if loss is None else values[1]
        if all(math.isfinite(v) for v in values):
            return
        what = f"loss {self.loss:g}" if self.loss is not None and not math.isfinite(self.loss) else "non-finite weights"
        raise TrainingDiverged(f"training diverged at step {trainer.global_step}: {what}")
