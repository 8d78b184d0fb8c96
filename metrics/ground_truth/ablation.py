"""Causal ground truth for K-composition (MEASURES.md, "Ground truth: ablation").

For writer h1 (layer l1) and reader h2 (layer l2 > l1), on the probe batch: mean-ablate h1's
output in the input of h2's *keys only* (queries, values and every other head untouched), then
measure how much h2's attention pattern moves and how much the repeated-token loss rises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from data.probe import ProbeBatch
from models.transformer import AttentionOnlyTransformer, causal_pattern


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


SEQUENCES_PER_CHUNK = 2048  # (writer, reader, sequence) rows forwarded at once: bounds memory on big models


def _repeated_loss_per_group(model, x: Tensor, first_layer: int, tokens: Tensor, probe: ProbeBatch) -> Tensor:
    """Repeated-token loss of each group of ``b = len(tokens)`` rows of the residual stream
    ``x [g * b, t, d]`` entering ``first_layer`` -> ``[g]``. Only the positions the loss scores
    are unembedded."""
    for layer in model.layers[first_layer:]:
        x = x + layer.head_outputs(x, layer.pattern(x)).sum(dim=1)
    b, start, n = len(tokens), probe.repeat_start, probe.n
    logits = model.unembed(x[:, start : start + n - 1])  # predicting tokens start+1 .. start+n-1
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least float32, e.g. for a bf16 model
    targets = tokens[:, start + 1 : start + n].repeat(len(x) // b, 1)
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.view(-1, b * (n - 1)).mean(dim=1)


def _reader_layer_effects(model, cache, tokens, probe, l2: int) -> tuple[Tensor, Tensor]:
    """Both effects of ablating each writer (the ``W = l2 * n_heads`` heads of layers < l2, in flat
    order) from the keys of each head of layer ``l2``: ``([W, n_heads], [W, n_heads])``.

    The clean pattern, outputs and loss are recomputed along the very same path as the ablated
    ones, so a writer that changes nothing has an effect of exactly 0, not rounding noise.
    """
    H = model.shape.n_heads
    layer, x = model.layers[l2], cache["resid_pre"][l2]  # (b, t, d)
    writes = torch.cat([out.transpose(0, 1) for out in cache["head_out"][:l2]])  # (W, b, t, d)
    x_keys = torch.cat([x[None], x - writes + writes.mean(dim=(1, 2), keepdim=True)])  # (1 + W, b, t, d): clean, then ablated
    n, b, t, d = x_keys.shape
    keys = layer.project(x_keys.reshape(n * b, t, d), layer.W_K).reshape(n, b, H, t, -1)
    patterns = causal_pattern(layer.project(x, layer.W_Q)[None], keys)  # (1 + W, b, H, t, t)
    pattern_change = 0.5 * (patterns[1:] - patterns[:1]).abs().sum(-1).mean(dim=(1, 3))  # (W, H)
    # each (writer, reader h2) run differs from the clean one only by h2's write at layer l2
    outputs = (patterns @ layer.project(x, layer.W_V)) @ layer.W_O[None, None]  # (1 + W, b, H, t, d)
    clean_out = outputs[0]
    clean_next = x + clean_out.sum(dim=1)  # (b, t, d)
    x_next = clean_next + (outputs[1:] - clean_out).transpose(1, 2)  # (W, H, b, t, d)
    rows = torch.cat([clean_next, x_next.reshape(-1, t, d)])  # the clean group first
    chunk = max(1, SEQUENCES_PER_CHUNK // b) * b
    losses = torch.cat([_repeated_loss_per_group(model, rows[i : i + chunk], l2 + 1, tokens, probe) for i in range(0, len(rows), chunk)])
    return pattern_change, (losses[1:] - losses[0]).reshape(-1, H)


@torch.inference_mode()
def key_ablation_effects(
    model: AttentionOnlyTransformer, probe: ProbeBatch, clean_run: tuple[Tensor, dict] | None = None
) -> KeyAblation:
    """The K-only mean-ablation effect of every earlier->later head pair on ``probe``.

    h1's write is replaced by its mean over the batch and positions in the residual stream that
    h2's keys read; h2's queries and values, and every other head, see the clean stream. Batched
    over all writers and all heads of each reader layer.

    ``clean_run``: ``model.run_with_cache(probe.tokens)`` in eval mode, if the caller has it already.
    """
    was_training = model.training
    model.eval()
    try:
        tokens = probe.tokens.to(model.W_E.device)
        _, cache = model.run_with_cache(tokens) if clean_run is None else clean_run
        L, H = model.shape.n_layers, model.shape.n_heads
        pattern_change = torch.full((L * H, L * H), float("nan"), dtype=torch.float64)
        loss_change = pattern_change.clone()
        for l2 in range(1, L):
            patterns, losses = _reader_layer_effects(model, cache, tokens, probe, l2)
            pattern_change[: l2 * H, l2 * H : (l2 + 1) * H] = patterns.double().cpu()
            loss_change[: l2 * H, l2 * H : (l2 + 1) * H] = losses.double().cpu()
    finally:
        model.train(was_training)
    return KeyAblation(pattern_change.reshape(L, H, L, H), loss_change.reshape(L, H, L, H))
