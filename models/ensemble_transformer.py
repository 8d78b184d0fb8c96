"""Many models of one shape trained as one: every weight carries a leading member axis ``[n, ...]``.

``EnsembleTransformer`` stacks ``n`` :class:`~models.transformer.AttentionOnlyTransformer` of one
:class:`~models.transformer.TransformerShape` and runs them in one pass of :mod:`models.forward`: each
projection is one batched GEMM over the member axis and attention is one ``scaled_dot_product_attention``
over ``member x batch``. Batched by a member axis rather than through ``torch.func.vmap`` over
``stack_module_state``: under ``vmap``, attention's backward falls back to a loop over members
(pytorch/pytorch #117016).

Interventions (``models/interventions.py``) act per member: :meth:`EnsembleTransformer.set_changes` gives
each member its own head changes, and a layer where any member has some runs those members through the
single model's explicit patterns (:func:`~models.interventions.attend`), the others through SDPA.

Its parameters have the single model's names and order, so member ``k``'s weights are
``{name: p[k]}``, and :func:`member_views` gives each member
as a plain ``AttentionOnlyTransformer`` whose weights are views of the stacked ones (no copy; every
metric, the trajectory and the reports read a member exactly as they read a single run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import forward
from models.interventions import HeadChange
from models.transformer import AttentionOnlyTransformer, TransformerShape


class StackedNorm(nn.Module):
    """The gains ``weight [n, d_model]`` of ``n`` pre-attention norms (LayerNorm without bias, or RMSNorm, as
    :func:`models.transformer.make_norm` makes them), applied by :func:`models.forward.normalize`."""

    def __init__(self, gains: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(gains)


class EnsembleLayer(nn.Module):
    """One attention layer of every member: ``W_Q, W_K, W_V [n, h, d, e]``, ``W_O [n, h, e, d]``, the
    optional ``norm.weight [n, d]`` and biases ``[n, h, e]`` / ``[n, d]``; ``changes[k]``: member ``k``'s
    interventions on this layer's heads now active (empty: none, and the fused path)."""

    def __init__(self, layers: Sequence[nn.Module], normalization: str) -> None:
        super().__init__()
        if normalization != "none":
            self.norm = StackedNorm(torch.stack([layer.norm.weight.detach() for layer in layers]))
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
            first = getattr(layers[0], name)
            stacked = None if first is None else nn.Parameter(torch.stack([getattr(m, name).detach() for m in layers]))
            self.register_parameter(name, stacked)
        self.changes: list[tuple[HeadChange, ...]] = []


class EnsembleTransformer(nn.Module):
    """``n`` attention-only transformers of one shape as stacked weights (see the module docstring)."""

    def __init__(self, members: Sequence[AttentionOnlyTransformer]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        shape = members[0].shape
        if any(m.shape != shape for m in members):
            raise ValueError("every member of an ensemble must have the same shape")
        self.shape: TransformerShape = shape
        self.size = len(members)
        self.W_E = nn.Parameter(torch.stack([m.W_E.detach() for m in members]))
        self.W_pos = nn.Parameter(torch.stack([m.W_pos.detach() for m in members]))
        self.layers = nn.ModuleList(
            EnsembleLayer([m.layers[i] for m in members], shape.normalization) for i in range(shape.n_layers)
        )
        if shape.normalization != "none":
            self.final_norm = StackedNorm(torch.stack([m.final_norm.weight.detach() for m in members]))
        self.W_U = nn.Parameter(torch.stack([m.W_U.detach() for m in members]))
        biases = members[0].b_U is not None
        self.register_parameter("b_U", nn.Parameter(torch.stack([m.b_U.detach() for m in members])) if biases else None)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[n, b, t, d_vocab]`` of every member for its own ``tokens [n, b, t]`` (:func:`models.forward.logits`)."""
        changes = [layer.changes or forward.NO_CHANGES for layer in self.layers]
        return forward.logits(dict(self.named_parameters()), tokens, self.shape, changes)

    def set_changes(self, members: Sequence[Sequence[tuple[HeadChange, ...]]]) -> None:
        """Each member's interventions now active: ``members[k][layer]``, its heads' changes in that layer (as
        :meth:`AttentionOnlyTransformer.set_changes` sets them on a single model's layers)."""
        if len(members) != self.size:
            raise ValueError(f"changes for {len(members)} members given to an ensemble of {self.size}")
        for index, layer in enumerate(self.layers):
            changes = [tuple(member[index]) for member in members]
            layer.changes = changes if any(changes) else []


def member_views(ensemble: EnsembleTransformer) -> list[AttentionOnlyTransformer]:
    """Each member as an ``AttentionOnlyTransformer`` whose weights are detached views of the
    ensemble's: always current (the optimizer updates in place), never copied, never trained through.
    Make them after the ensemble has its final device and dtype (a move replaces the storage). Each weight
    is registered as a parameter that shares the view's storage (``nn.Parameter`` wraps, it does not
    copy); ``member_index`` marks the model as a view (:func:`standalone`)."""
    views = []
    for index in range(ensemble.size):
        with torch.device("meta"):
            view = AttentionOnlyTransformer(ensemble.shape)
        for name, stacked in ensemble.named_parameters():
            module_name, _, attribute = name.rpartition(".")
            module = view.get_submodule(module_name) if module_name else view
            module.register_parameter(attribute, nn.Parameter(stacked.detach()[index], requires_grad=False))
        view.member_index = index  # a plain attribute: the view is of member `index` of an ensemble
        views.append(view.eval())
    return views


def standalone(model: AttentionOnlyTransformer) -> AttentionOnlyTransformer:
    """``model`` itself when its weights are its own parameters; a member view (:func:`member_views`)
    copied into a model of its own: trainable parameters, the view's device, dtype and interventions, no
    random draw. What needs a member's gradients (the LLC's SGLD chains) works on this copy."""
    if getattr(model, "member_index", None) is None:
        return model
    with torch.device("meta"):
        copy = AttentionOnlyTransformer(model.shape)
    first = next(model.parameters())
    copy = copy.to_empty(device=first.device).to(first.dtype)
    copy.load_state_dict(model.state_dict())
    copy.set_changes({index: layer.changes for index, layer in enumerate(model.layers)})
    return copy.train(model.training)


def member_losses(logits: Tensor, tokens: Tensor) -> Tensor:
    """Each member's mean next-token cross-entropy, ``[n]``, of ``logits [n, b, t, v]`` on ``tokens [n, b, t]``
    (the single model's :func:`models.lit_module.next_token_loss`, member by member)."""
    n = logits.shape[0]
    per_token = F.cross_entropy(logits[:, :, :-1].flatten(0, 2), tokens[:, :, 1:].flatten(), reduction="none")
    return per_token.view(n, -1).mean(dim=1)


def clip_member_gradients(parameters: Sequence[Tensor], max_norms: Tensor) -> Tensor:
    """Scale each member's gradients so that their 2-norm is at most ``max_norms[k]`` (``[n]``; 0 or
    less: no clipping), as ``torch.nn.utils.clip_grad_norm_`` does for one model: coefficient
    ``max_norm / (norm + 1e-6)``, clamped at 1. Returns each member's norm before clipping, ``[n]``."""
    grads = [p.grad for p in parameters if p.grad is not None]
    n = grads[0].shape[0]
    norms = torch.stack([g.reshape(n, -1).norm(dim=1) for g in grads]).norm(dim=0)  # (n,)
    coefficients = (max_norms.to(norms) / (norms + 1e-6)).clamp(max=1.0)
    coefficients = torch.where(max_norms.to(norms) > 0, coefficients, torch.ones_like(coefficients))
    for g in grads:
        g.mul_(coefficients.view(n, *([1] * (g.dim() - 1))))
    return norms
