"""LightningModule: next-token training of an :class:`~models.ensemble_transformer.EnsembleTransformer`, every member
on its own batch, with its own optimizer settings and gradient clipping."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
from torch import Tensor

from models.ensemble_optimizer import EnsembleAdamW
from models.ensemble_transformer import EnsembleTransformer, clip_member_gradients, member_losses
from models.optimizer import OptimizerSettings
from models.transformer import AttentionOnlyTransformer


class EnsembleLM(L.LightningModule):
    """Trains ``members`` as one model: the loss it steps on is the sum of the members' mean losses (so
    each member's gradient is its own loss's), clipped member by member to ``clip[k]`` (0: none).

    ``losses``: the last step's loss per member ``[n]``, detached (what the members' records read);
    ``active``: the members still training (a diverged one is stopped: :meth:`stop`)."""

    def __init__(
        self, members: Sequence[AttentionOnlyTransformer], optims: Sequence[OptimizerSettings], clip: Sequence[float]
    ) -> None:
        super().__init__()
        self.model = EnsembleTransformer(members)
        self.optims = list(optims)
        self.register_buffer("clip", torch.tensor([float(c or 0) for c in clip]), persistent=False)
        self.register_buffer("active", torch.ones(len(members), dtype=torch.bool), persistent=False)
        self.losses: Tensor | None = None

    def training_step(self, tokens: Tensor, batch_idx: int) -> Tensor:
        losses = member_losses(self.model(tokens), tokens)  # (n,)
        self.losses = losses.detach()
        return torch.where(self.active, losses, torch.zeros_like(losses)).sum()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Each member's gradient norm clipped to its own ``trainer.gradient_clip_val``, never one global norm."""
        if bool((self.clip > 0).any()):
            clip_member_gradients(list(self.model.parameters()), self.clip)

    def stop(self, member: int) -> None:
        """Stop training member ``member``: its loss leaves the sum and its weights stay where they are."""
        self.active[member] = False
        optimizer = self.optimizers(use_pl_optimizer=False)
        optimizer.stop(member)

    def configure_optimizers(self) -> EnsembleAdamW:
        return EnsembleAdamW(self.model.parameters(), self.optims)
