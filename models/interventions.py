"""Changes to attention heads while the model learns: pattern clamps, ablations, temperature; and the
plan of a run's interventions (which heads, which steps), read from the config's ``intervention``.

The forward-pass changes (:class:`HeadChange`) act at two points of each head, the same ones the
metrics read from :meth:`~models.transformer.AttentionOnlyTransformer.run_with_cache`: its pattern
``[b, t, t]`` and its output ``z [b, t, d_head]`` before ``W_O`` (so its write ``z @ W_O`` changes
with it). After Singh et al. 2024 ("What needs to go right for an induction head?", the
"artificial optogenetics" of ``aadityasingh/icl-dynamics``, JAX), written here for our PyTorch model:

- ``clamp``: the pattern becomes ``(1 - s)·own + s·target`` (:data:`TARGETS`, :func:`target_pattern`);
  at ``s = 1`` the target itself, so the head's queries and keys get no gradient through it;
- ``ablate``: the head's output ``z`` replaced (:data:`REPLACEMENTS`, :func:`replacement_of`); with
  ``keep="pattern"`` its values are replaced and its own pattern still mixes them, with
  ``keep="values"`` its pattern is replaced and still mixes its own values (Singh's pattern- and
  value-preserving ablations). A replacement is detached: no gradient reaches the head through it;
- ``temperature``: the head's scores ``q kᵀ / sqrt(d_head)`` multiplied by ``factor`` before the softmax.

Freezing and grafting act on weights, not activations: ``callbacks/interventions.py``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from models.attention import attention_scores, causal_softmax

Kind = Literal["none", "clamp", "ablate", "freeze", "temperature", "graft"]
Target = Literal["prev_token", "induction", "uniform", "bos"]
Replacement = Literal["zero", "mean", "resample"]
Keep = Literal["none", "pattern", "values"]
Circuit = Literal["qk", "ov", "both"]
KINDS: tuple[Kind, ...] = get_args(Kind)
TARGETS: tuple[Target, ...] = get_args(Target)
"""Pattern targets: the previous token (position 0 attends to itself); induction: the token after the
last earlier occurrence of the current token (BOS, position 0, where it has none); uniform over the
causal prefix; BOS (position 0)."""
REPLACEMENTS: tuple[Replacement, ...] = get_args(Replacement)
KEEPS: tuple[Keep, ...] = get_args(Keep)
CIRCUITS: tuple[Circuit, ...] = get_args(Circuit)
CHOSEN = {"top_prev_token": "prev_token", "top_induction": "induction"}
"""Head names chosen by the model at ``from_step``: the head with the highest score on the probe then."""
FORWARD_KINDS = ("clamp", "ablate", "temperature")


class InterventionError(ValueError):
    """An intervention that cannot run; the message says which key and why, in one line."""


@dataclass(frozen=True)
class HeadChange:
    """One change to head ``head`` of a layer, applied in the forward pass (see the module docstring)."""

    head: int
    kind: Literal["clamp", "ablate", "temperature"]
    target: Target = "prev_token"
    strength: float = 1.0
    replacement: Replacement = "zero"
    keep: Keep = "none"
    factor: float = 1.0


def replacement_of(outputs: Tensor, kind: str) -> Tensor:
    """What replaces each sequence's ``outputs [b, ...]``: ``zero``; ``mean`` (also ``per_position``):
    the batch mean, at each position, ``[1, ...]``; ``pooled``: the mean over the batch and dimension 2
    (positions of ``[b, H, t, ·]``); ``resample``: the next sequence's (cyclically), ``[b, ...]``.
    The training-time ablations and the ablation ground truth (``metrics/ground_truth/ablation.py``) both use it."""
    if kind == "zero":
        return torch.zeros_like(outputs)
    if kind in ("mean", "per_position"):
        return outputs.mean(dim=0, keepdim=True)
    if kind == "pooled":
        return outputs.mean(dim=(0, 2), keepdim=True)
    if kind == "resample":
        return outputs.roll(-1, dims=0)
    raise ValueError(f"unknown replacement {kind!r}; choose one of zero, mean, per_position, pooled, resample")


def target_pattern(target: Target, tokens: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The pattern ``[b, t, t]`` (rows: queries, sums to 1, causal) a clamp to ``target`` imposes on
    ``tokens [b, t]``, in ``dtype`` (default: torch's)."""
    dtype = dtype or torch.get_default_dtype()
    b, t = tokens.shape
    rows = torch.arange(t, device=tokens.device)
    if target == "uniform":
        causal = torch.ones(t, t, dtype=dtype, device=tokens.device).tril()
        return (causal / causal.sum(-1, keepdim=True)).expand(b, t, t)
    if target == "prev_token":
        keys = (rows - 1).clamp(min=0).expand(b, t)
    elif target == "bos":
        keys = torch.zeros(b, t, dtype=torch.long, device=tokens.device)
    elif target == "induction":
        earlier = (tokens[:, :, None] == tokens[:, None, :]) & (rows[None, :] < rows[:, None])  # (b, i, j): j < i
        last = torch.where(earlier, rows, -1).amax(dim=-1)  # (b, i): the last earlier occurrence, -1 for none
        keys = torch.where(last >= 0, last + 1, 0)
    else:
        raise ValueError(f"unknown pattern target {target!r}; choose one of {TARGETS}")
    return torch.nn.functional.one_hot(keys, t).to(dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, changes: Sequence[HeadChange] = (), tokens: Tensor | None = None):
    """Causal attention with explicit patterns and ``changes``: ``q, k, v [b, h, t, e]`` ->
    ``(pattern [b, h, t, t], z [b, h, t, e])``, ``pattern`` the one that mixed the values.
    ``tokens [b, t]``: needed by a clamp only. Without changes, ``softmax(q kᵀ/sqrt(e)) @ v``."""
    scores = attention_scores(q, k)  # (b, h, t_query, t_key)
    heads = q.shape[1]
    temperatures = [c for c in changes if c.kind == "temperature"]
    if temperatures:
        factor = torch.ones(heads, dtype=scores.dtype, device=scores.device)
        for change in temperatures:
            factor[change.head] = factor[change.head] * change.factor
        scores = scores * factor[:, None, None]
    pattern = causal_softmax(scores)
    if not changes:
        return pattern, pattern @ v
    patterns, values = list(pattern.unbind(1)), list(v.unbind(1))
    for change in changes:
        h = change.head
        if change.kind == "clamp":
            if tokens is None:
                raise ValueError("a pattern clamp needs the tokens")
            target = target_pattern(change.target, tokens, pattern.dtype)
            s = change.strength
            patterns[h] = target if s == 1 else (1 - s) * patterns[h] + s * target
        elif change.kind == "ablate" and change.keep == "values":
            patterns[h] = replacement_of(patterns[h].detach(), change.replacement).expand_as(patterns[h])
        elif change.kind == "ablate" and change.keep == "pattern":
            values[h] = replacement_of(values[h].detach(), change.replacement).expand_as(values[h])
    pattern, v = torch.stack(patterns, 1), torch.stack(values, 1)
    z = pattern @ v
    outputs = [c for c in changes if c.kind == "ablate" and c.keep == "none"]
    if outputs:
        heads_z = list(z.unbind(1))
        for change in outputs:
            heads_z[change.head] = replacement_of(heads_z[change.head].detach(), change.replacement).expand_as(
                heads_z[change.head]
            )
        z = torch.stack(heads_z, 1)
    return pattern, z


HEAD_NAME = re.compile(r"^L(\d+)(?:H(\d+))?$")


@dataclass(frozen=True)
class Intervention:
    """One intervention of a run (one entry of the config's ``intervention``, or of its ``also``).

    ``heads``: names as given, ``L0H1`` (a head), ``L0`` (every head of layer 0), or a key of
    :data:`CHOSEN` (the model's top head by that score at ``from_step``). Active on the optimizer
    steps ``from_step <= global_step < until_step`` (None: to the end of training)."""

    kind: Kind = "none"
    heads: tuple[str, ...] = ()
    from_step: int = 0
    until_step: int | None = None
    target: Target = HeadChange.target
    strength: float = HeadChange.strength
    replacement: Replacement = HeadChange.replacement
    keep: Keep = HeadChange.keep
    circuit: Circuit = "both"
    factor: float = HeadChange.factor
    source: str | None = None
    source_step: int | None = None
    frozen: bool = False

    @classmethod
    def from_config(cls, node: dict) -> Intervention:
        """From one config entry (a dict with the schema's keys, enums as strings; a key it lacks
        takes the default here, the one place the defaults are written)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"heads"}
        values = {key: value for key, value in node.items() if key in names}
        return cls(**values, heads=tuple(str(h) for h in node.get("heads") or ()))

    def active(self, step: int) -> bool:
        return self.from_step <= step and (self.until_step is None or step < self.until_step)

    @property
    def freezes(self) -> bool:
        return self.kind == "freeze" or (self.kind == "graft" and self.frozen)

    def label(self, heads: Sequence[str] | None = None) -> str:
        """``clamp_prev_token[L0H0] s=0.5 steps 0-end``: kind, heads (``heads``: as resolved), the
        options that are not the default, and the window."""
        name = f"clamp_{self.target}" if self.kind == "clamp" else self.kind
        options = {
            "clamp": [f"s={self.strength:g}"] if self.strength != 1 else [],
            "ablate": [self.replacement] + ([f"keep {self.keep}"] if self.keep != "none" else []),
            "freeze": [self.circuit] if self.circuit != "both" else [],
            "temperature": [f"x{self.factor:g}"],
            "graft": [f"from {self.source}@{self.source_step if self.source_step is not None else 'last'}"]
            + (["frozen"] if self.frozen else []),
        }.get(self.kind, [])
        window = f"steps {self.from_step}-{self.until_step if self.until_step is not None else 'end'}"
        return " ".join([f"{name}[{','.join(heads or self.heads)}]", *options, window])

    def problems(self, shape, max_steps: int) -> list[str]:
        """What makes this intervention impossible on a model of ``shape`` trained ``max_steps``
        steps, one sentence each (the graft's source is checked by ``conf/validate.py``)."""
        where = f"intervention {self.label()}"
        problems = []
        if self.kind not in KINDS:
            return [f"intervention.kind={self.kind!r}: unknown; choose one of {KINDS}"]
        if self.kind == "none":
            return []
        if not self.heads:
            problems.append(f"{where}: name its heads, e.g. intervention.heads=[L0H0] (or L0, top_prev_token)")
        for name in self.heads:
            problem = head_problem(name, shape)
            if problem:
                problems.append(f"{where}: {problem}")
        if self.from_step < 0:
            problems.append(f"{where}: from_step={self.from_step} must be >= 0")
        if self.until_step is not None and self.until_step < self.from_step:
            problems.append(f"{where}: from_step={self.from_step} > until_step={self.until_step}")
        if self.from_step >= max_steps:
            problems.append(f"{where}: from_step={self.from_step} is not before trainer.max_steps={max_steps}")
        if self.kind == "clamp" and self.target not in TARGETS:
            problems.append(f"{where}: target={self.target!r} unknown; choose one of {TARGETS}")
        if self.kind == "clamp" and not 0 <= self.strength <= 1:
            problems.append(f"{where}: strength={self.strength} must be in [0, 1]")
        if self.kind == "ablate" and self.replacement not in REPLACEMENTS:
            problems.append(f"{where}: replacement={self.replacement!r} unknown; choose one of {REPLACEMENTS}")
        if self.kind == "ablate" and self.keep not in KEEPS:
            problems.append(f"{where}: keep={self.keep!r} unknown; choose one of {KEEPS}")
        if self.kind == "freeze" and self.circuit not in CIRCUITS:
            problems.append(f"{where}: circuit={self.circuit!r} unknown; choose one of {CIRCUITS}")
        if self.kind == "temperature" and not (math.isfinite(self.factor) and self.factor >= 0):
            problems.append(f"{where}: factor={self.factor} must be a finite number >= 0")
        if self.kind == "graft" and not self.source:
            problems.append(f"{where}: name the run to graft from, intervention.source=RUN_DIR (with a trajectory/)")
        if self.kind == "graft" and any(name in CHOSEN for name in self.heads):
            problems.append(f"{where}: a graft names its heads (L0H1 or L0), it cannot choose them")
        return problems

    def changes(self, heads: Sequence[tuple[int, int]]) -> dict[int, list[HeadChange]]:
        """The forward-pass changes of this intervention on the resolved ``heads`` ``[(layer, head)]``, by layer."""
        if self.kind not in FORWARD_KINDS:
            return {}
        by_layer: dict[int, list[HeadChange]] = {}
        for layer, head in heads:
            change = HeadChange(head, self.kind, self.target, self.strength, self.replacement, self.keep, self.factor)
            by_layer.setdefault(layer, []).append(change)
        return by_layer


def head_problem(name: str, shape) -> str | None:
    """Why a head name does not name heads of a model of ``shape`` (None: it does)."""
    if name in CHOSEN:
        return None
    match = HEAD_NAME.match(name)
    if match is None:
        return f"head {name!r}: write L<layer>H<head> (L0H1), L<layer> (every head of it), or one of {sorted(CHOSEN)}"
    layer, head = int(match[1]), None if match[2] is None else int(match[2])
    if layer >= shape.n_layers or (head is not None and head >= shape.n_heads):
        return f"head {name!r} does not exist: the model has layers L0-L{shape.n_layers - 1}, heads H0-H{shape.n_heads - 1}"
    return None


def named_heads(name: str, shape) -> list[tuple[int, int]]:
    """The heads ``[(layer, head)]`` a name (``L0H1``, ``L0``) stands for."""
    match = HEAD_NAME.match(name)
    if match is None:
        raise InterventionError(head_problem(name, shape) or f"head {name!r} is chosen, not named")
    layer = int(match[1])
    return [(layer, int(match[2]))] if match[2] is not None else [(layer, h) for h in range(shape.n_heads)]


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def silenced_throughout(plan: Sequence[Intervention], n_heads: int) -> set[tuple[int, int]]:
    """The heads ``(layer, head)`` an ``ablate`` intervention replaces from step 0 to the end of training
    (whatever it keeps, no head reads their tokens through them). A head chosen by its score at a step
    (:data:`CHOSEN`) is not known before the run: not counted."""
    silenced = set()
    for intervention in plan:
        if intervention.kind != "ablate" or intervention.from_step > 0 or intervention.until_step is not None:
            continue
        for name in intervention.heads:
            if named := HEAD_NAME.match(name):
                heads = range(n_heads) if named[2] is None else [int(named[2])]
                silenced |= {(int(named[1]), head) for head in heads}
    return silenced


def plan_of(node: dict | None) -> list[Intervention]:
    """A run's interventions from its config's ``intervention`` (a dict; None or kind none: none),
    the main entry first, then those of ``also``."""
    if not node:
        return []
    entries = [node, *(node.get("also") or [])]
    return [Intervention.from_config(entry) for entry in entries if str(entry.get("kind", "none")) != "none"]


def describe(plan: Sequence[Intervention], chosen: dict[int, list[str]] | None = None) -> str:
    """One line naming a run's interventions (``none`` without any); ``chosen``: resolved heads by index."""
    if not plan:
        return "none"
    return "; ".join(i.label((chosen or {}).get(n)) for n, i in enumerate(plan))


EVENT_STEPS = 10
"""Tracker steps kept in the weight trajectory after an intervention starts or ends (and one before)."""


def event_steps(plan: Sequence[Intervention], max_steps: int, every: int) -> tuple[int, ...]:
    """The steps around each window's edges that the weight trajectory keeps: the tracker step
    before a start (``from_step > 0``) or an end (``until_step``), the edge, and :data:`EVENT_STEPS`
    tracker steps (``every``) after it, within ``[0, max_steps]``."""
    steps: set[int] = set()
    for intervention in plan:
        for edge in (intervention.from_step or None, intervention.until_step):
            if edge is not None:
                steps.update(
                    s for s in range(edge - every, edge + EVENT_STEPS * every + 1, every) if 0 <= s <= max_steps
                )
                steps.add(edge)
    return tuple(sorted(steps))
