"""Loss views on the probe batch (Olsson et al. 2022): first occurrences vs repeated tokens, and
the in-context-learning score."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from data.probe import ProbeBatch


def token_losses(logits: Tensor, tokens: Tensor) -> Tensor:
    """Per-token loss ``[batch, pos - 1]``: entry ``j`` is the loss of predicting ``tokens[:, j + 1]``."""
    b, t, v = logits.shape
    flat = F.cross_entropy(
        logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1), reduction="none"
    )  # no transposed copy
    return flat.view(b, t - 1)


def first_occurrence_loss(losses: Tensor, probe: ProbeBatch) -> Tensor:
    """Mean loss on the first copy's tokens ``t_1 .. t_n`` (unpredictable: about ``ln n_random``;
    ``t_1`` is unscored without BOS)."""
    return losses[:, probe.first].mean()


def repeated_loss(losses: Tensor, probe: ProbeBatch) -> Tensor:
    """Mean loss on the second copy's tokens ``t_2 .. t_n``.

    ``t_1``'s repeat is left out: nothing in the context announces where the repeat begins, so
    induction cannot predict it.
    """
    return losses[:, probe.repeated].mean()


def in_context_learning_score(losses: Tensor, fraction: float = 0.25) -> Tensor:
    """Mean loss over the last ``fraction`` of positions minus over the first ``fraction``.

    Olsson et al. 2022 take loss at token 500 minus token 50; on short probes we average windows.
    Negative means later tokens are predicted better.
    """
    width = max(1, round(losses.shape[1] * fraction))
    return losses[:, -width:].mean() - losses[:, :width].mean()
