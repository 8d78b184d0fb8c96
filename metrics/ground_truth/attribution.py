"""First-order estimate of the K-only path ablation, and the choice between it and the exact one.

Attribution patching (Nanda 2023, "Attribution Patching: Activation Patching At Industrial
Scale"; Syed, Rager & Conmy 2023, "Attribution Patching Outperforms Automated Circuit
Discovery") replaces each patched forward pass by a linear approximation around the clean run.

Ablating writer w from reader h2's keys moves h2's key input, and nothing else, by
``Δx_w = write'_w - write_w`` (``[b, t, d_model]``; ``write'`` the replacement of the ablation's
kind, :func:`~models.interventions.replacement_of`). To first order the repeated-token
loss then moves by::

    ΔL(w -> h2) ≈ Σ_{b,t} ⟨∂L/∂x_key^{h2}[b, t], write'_w[b, t] - write_w[b, t]⟩

where ``x_key^{h2}`` is the residual stream (before the norm) entering reader h2's key projection
only. The model's own forward pass (its interventions included) and one backward pass to every
layer's keys give ``∂L/∂k^{h2}`` for every reader at once; each head's vector-Jacobian product
through its own key projection and norm (the model's, so any position scheme or bias it has) turns
that into ``∂L/∂x_key^{h2}``. The sum over ``(b, t, d)`` is one GEMM per (writer layer, reader layer).

Limits. The estimate is exact to first order in the size of the ablation (checked against the
exact ablation at ``scale = ±1e-4``), but the mean ablation is not small. Where attention or the
output softmax saturates the gradient at the clean run vanishes: on the hand-built induction
circuit (attention logits x30) the exact ablation costs 2.5 nats and the estimate is ~1e-14
(Kramár et al. 2024, "AtP*", discuss this failure mode). Measured Spearman correlation with the
exact loss change: 0.95-1.0 on random 3-layer models, 0.36-0.99 on small models trained briefly
on repeated tokens. Prefer the exact ablation wherever it is affordable.

Cost: about two forward passes (only the keys' gradients are asked for, no weight gradient),
plus the exact pattern change, which needs only each reader's layer
(:func:`~metrics.ground_truth.ablation.key_pattern_changes`; ``O(Σ_l2 l2·H·b·t·(e·He + H·t·e))``,
the larger part for deep models). Memory: the clean run, plus the key-input gradients
``(L-1)·H·b·t·d``.
"""

from __future__ import annotations

import copy
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from data.probe import ProbeBatch
from metrics.ground_truth.ablation import (
    DEFAULT_MAX_CHUNK_BYTES,
    AblationKind,
    KeyAblation,
    ablation_cost,
    key_ablation_effects,
    key_pattern_changes,
)
from models.interventions import replacement_of
from models.transformer import AttentionOnlyTransformer, TransformerShape

AblationMethod = Literal["exact", "attribution", "auto"]
METHODS: tuple[AblationMethod, ...] = get_args(AblationMethod)
EXACT_MAX_FLOPS = 2e10
"""``auto`` runs the exact ablation while :func:`~metrics.ground_truth.ablation.ablation_cost` is
below this, else attribution patching. Measured on one CPU core (probe of 32 x 33 tokens): the
2 x 12 x 768 x 64 model, 11 GFLOP, took 0.55 s exact and 0.6 s by attribution, so exact it is;
4 x 8 x 256 x 32, 104 GFLOP, took 2.6 s exact and 0.5 s by attribution. 20 GFLOP is about a
second there, and far less on a GPU."""


def key_attribution_effects(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    clean_run: tuple[Tensor, dict] | None = None,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    kind: AblationKind = "per_position",
) -> KeyAblation:
    """The K-only ablation of every earlier->later head pair, with ``loss_change`` estimated to
    first order (see the module docstring) and ``pattern_change`` exact.

    Leaves the model's weights, their ``.grad``, its train/eval mode and every RNG untouched.
    Gradients run in float32 on the model's device (float64 for a float64 model).
    ``clean_run``: ``model.run_with_cache(probe.tokens)`` in eval mode, if the caller has it already.
    Returns ``[L, H, L, H]`` float64 CPU tensors, NaN unless the reader's layer is later.
    """
    was_training = model.training
    model.eval()
    try:
        if model.W_E.dtype in (torch.float16, torch.bfloat16):  # gradients in float32 at least
            model = copy.deepcopy(model).float()
            clean_run = None
        tokens = probe.tokens.to(model.W_E.device)
        if clean_run is None:
            with torch.inference_mode():
                clean_run = model.run_with_cache(tokens)
        pattern_change = key_pattern_changes(model, probe, clean_run, max_chunk_bytes=max_chunk_bytes, kind=kind)
        loss_change = _first_order_loss_changes(model, tokens, probe, clean_run[1]["head_out"], kind)
    finally:
        model.train(was_training)
    return KeyAblation(pattern_change, loss_change)


def choose_method(
    shape: TransformerShape,
    probe_batch: int,
    probe_len: int,
    method: AblationMethod = "auto",
    max_exact_flops: float = EXACT_MAX_FLOPS,
    n_scored: int | None = None,
) -> str:
    """``"exact"`` or ``"attribution"``: ``method`` itself unless it is ``"auto"``, which picks exact
    while :func:`~metrics.ground_truth.ablation.ablation_cost` is below ``max_exact_flops``
    (``n_scored``: the probe's scored positions, :func:`~metrics.ground_truth.ablation.ablation_cost`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    return "exact" if ablation_cost(shape, probe_batch, probe_len, n_scored) < max_exact_flops else "attribution"


def ablation_effects(
    model: AttentionOnlyTransformer,
    probe: ProbeBatch,
    method: AblationMethod = "auto",
    clean_run: tuple[Tensor, dict] | None = None,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    max_exact_flops: float = EXACT_MAX_FLOPS,
    kind: AblationKind = "per_position",
) -> tuple[KeyAblation, str]:
    """The K-only ablation effects of every pair and the method that computed them
    (``"exact"`` or ``"attribution"``, see :func:`choose_method`)."""
    b, t = probe.tokens.shape
    scored = probe.repeated.stop - probe.repeated.start
    used = choose_method(model.shape, b, t, method, max_exact_flops, scored)
    compute = key_ablation_effects if used == "exact" else key_attribution_effects
    return compute(model, probe, clean_run, max_chunk_bytes=max_chunk_bytes, kind=kind), used


def _first_order_loss_changes(
    model: AttentionOnlyTransformer,
    tokens: Tensor,
    probe: ProbeBatch,
    writes: list[Tensor],
    kind: AblationKind = "per_position",
) -> Tensor:
    """``[L, H, L, H]`` float64 CPU: ``Σ_{b,t} ⟨∂L/∂x_key^{h2}, write'_w - write_w⟩`` for every pair
    (``write'``: the replacement of ``kind``); ``writes[l]``: the clean run's head outputs ``[b, H, t, d]``."""
    L, H = model.shape.n_layers, model.shape.n_heads
    gradients = _key_input_gradients(model, tokens, probe)  # [l2 - 1]: (H, b·t·d)
    loss_change = torch.full((L, H, L, H), float("nan"), dtype=torch.float64, device="cpu")
    for l1 in range(L - 1):
        write = writes[l1].to(gradients[0].dtype)  # (b, H, t, d)
        shift = (replacement_of(write, kind) - write).transpose(0, 1).flatten(1)  # (H, b·t·d)
        for l2 in range(l1 + 1, L):
            loss_change[l1, :, l2] = (shift @ gradients[l2 - 1].T).cpu().double()  # (H writers, H readers)
    return loss_change


def _key_input_gradients(model: AttentionOnlyTransformer, tokens: Tensor, probe: ProbeBatch) -> list[Tensor]:
    """``∂L/∂x_key`` of every head of layers 1 .. L-1, as ``[H, b·t·d]`` per layer: the model's own
    forward pass (``run_with_cache``, its interventions included) and one backward pass to each
    layer's keys, then each head's vector-Jacobian product through its own key projection
    (:meth:`~models.transformer.AttentionLayer.key_input_gradients`): the gradient through that head's
    keys (and everything downstream of them), not the stream's total gradient. ``torch.autograd.grad``
    asks for the keys alone, so no weight gradient is computed and every ``.grad`` is left alone.
    """
    scored = probe.repeated
    with torch.inference_mode(False), torch.enable_grad():
        tokens = tokens.clone()  # a copy made under inference mode (a GPU's) cannot be saved for backward
        targets = tokens[:, scored.start + 1 : scored.stop + 1]
        logits, cache = model.run_with_cache(tokens, head_out=False)
        loss = F.cross_entropy(logits[:, scored].flatten(0, 1), targets.flatten())  # the repeated-token loss
        key_gradients = torch.autograd.grad(loss, cache["k"][1:], materialize_grads=True)
        pos = model.positions(tokens.shape[1])
        return [
            layer.key_input_gradients(x, gradient, pos).transpose(0, 1).flatten(1)  # (H, b·t·d)
            for layer, x, gradient in zip(model.layers[1:], cache["resid_pre"][1:], key_gradients)
        ]
