"""Causal ground truth for K-composition (MEASURES.md, "Ground truth: ablation").

For writer h1 (layer l1) and reader h2 (layer l2 > l1), on the probe batch: mean-ablate h1's
output in the input of h2's *keys only* (queries, values and every other head untouched), then
measure how much h2's attention pattern moves and how much the repeated-token loss rises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from data.probe import ProbeBatch
from metrics.composition import layer_order_pairs
from metrics.loss_views import repeated_loss, token_losses
from models.transformer import AttentionOnlyTransformer


@dataclass(frozen=True)
class KeyAblation:
    """Per pair ``[n_layers, n_heads, n_layers, n_heads]``, NaN unless the reader's layer is later.

    ``pattern_change``: mean total-variation distance ``½ Σ_j |a_ij - a'_ij|`` of h2's attention
    rows, in [0, 1]. ``loss_change``: repeated-token loss after minus before (nats; > 0 hurts).
    """

    pattern_change: Tensor
    loss_change: Tensor

    def effects(self) -> dict[str, Tensor]:
        """Both effects by name: ``{"loss_change": ..., "pattern_change": ...}``."""
        return {"loss_change": self.loss_change, "pattern_change": self.pattern_change}


def key_only_ablated_pattern(model, cache, writer: tuple[int, int], reader: tuple[int, int]) -> Tensor:
    """h2's pattern ``[batch, query, key]`` when its keys read the residual stream with h1's write
    replaced by its mean over the batch and positions."""
    (l1, h1), (l2, h2) = writer, reader
    write = cache["head_out"][l1][:, h1]  # (b, t, d)
    x = cache["resid_pre"][l2]
    x_key = x - write + write.mean(dim=(0, 1), keepdim=True)
    return model.layers[l2].pattern(x, x_key)[:, h2]


def forward_from_layer(model: AttentionOnlyTransformer, x: Tensor, first_layer: int) -> Tensor:
    """Logits from the residual stream ``x`` entering layer ``first_layer``."""
    for layer in model.layers[first_layer:]:
        x = x + layer.head_outputs(x, layer.pattern(x)).sum(dim=1)
    return model.unembed(x)


@torch.inference_mode()
def key_ablation_effects(
    model: AttentionOnlyTransformer, probe: ProbeBatch, clean_run: tuple[Tensor, dict] | None = None
) -> KeyAblation:
    """The K-only mean-ablation effect of every earlier->later head pair on ``probe``.

    ``clean_run``: ``model.run_with_cache(probe.tokens)`` in eval mode, if the caller has it already.
    """
    was_training = model.training
    model.eval()
    try:
        tokens = probe.tokens.to(model.W_E.device)
        logits, cache = model.run_with_cache(tokens) if clean_run is None else clean_run
        clean = repeated_loss(token_losses(logits.float(), tokens), probe.repeat_start, probe.n)
        L, H = model.shape.n_layers, model.shape.n_heads
        pattern_change = torch.full((L * H, L * H), float("nan"), dtype=torch.float64)
        loss_change = pattern_change.clone()
        for w, r in zip(*(idx.tolist() for idx in layer_order_pairs(L, H))):
            (l1, h1), (l2, h2) = divmod(w, H), divmod(r, H)
            ablated = key_only_ablated_pattern(model, cache, (l1, h1), (l2, h2))  # (b, t, t)
            pattern_change[w, r] = 0.5 * (ablated - cache["pattern"][l2][:, h2]).abs().sum(-1).mean().item()
            patterns = cache["pattern"][l2].clone()
            patterns[:, h2] = ablated
            x = cache["resid_pre"][l2]
            x = x + model.layers[l2].head_outputs(x, patterns).sum(dim=1)
            ablated_logits = forward_from_layer(model, x, l2 + 1)
            loss = repeated_loss(token_losses(ablated_logits.float(), tokens), probe.repeat_start, probe.n)
            loss_change[w, r] = (loss - clean).item()
    finally:
        model.train(was_training)
    return KeyAblation(pattern_change.reshape(L, H, L, H), loss_change.reshape(L, H, L, H))
