"""LightningModule: next-token training of an :class:`AttentionOnlyTransformer`."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from models.optimizer import OptimizerSettings
from models.transformer import AttentionOnlyTransformer, InitScheme, TransformerShape


def next_token_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits [b, t, v]`` at predicting ``tokens[:, 1:]``."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class InductionLM(L.LightningModule):
    """Trains the transformer with AdamW, a linear warmup, and logs ``train/loss``.

    Gradient clipping is the Trainer's (``trainer.gradient_clip_val``).
    """

    def __init__(
        self,
        shape: TransformerShape,
        optim: OptimizerSettings | None = None,
        init: InitScheme = "fan_in",
        init_std: float | None = None,
    ) -> None:
        super().__init__()
        self.model = AttentionOnlyTransformer(shape, init, init_std)
        self.optim = optim or OptimizerSettings()

    def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
        loss = next_token_loss(self.model(tokens), tokens)
        if self.is_logging_step():
            self.log("train/loss", loss)
        return loss

    def is_logging_step(self) -> bool:
        """Whether Lightning will write logs after this step. ``self.log`` costs about as much as
        a tenth of a training step here, so it is called only when its value will be written."""
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer (Lightning's own words)
            return True
        if trainer.log_every_n_steps < 1:
            return False  # Lightning's "never log"
        return (self.global_step + 1) % trainer.log_every_n_steps == 0  # Lightning's own rule

    def configure_optimizers(self):
        o = self.optim
        optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas)
        )
        if o.warmup_steps <= 0:
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / o.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}
