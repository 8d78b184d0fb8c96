"""Interventions during training, scheduled by the optimizer step (``models/interventions.py`` says
what each kind does to the forward pass).

Before each training step (and before the tracker measures a step) the active forward-pass changes
are set on the model from ``global_step`` alone, so a resumed run sets the same ones. Freezing and
grafting act on weights here:

- **freeze**: the frozen slices' gradients are zeroed before the optimizer step (so gradient
  clipping and Adam's moments never see them) and the slices are written back after it, which also
  undoes weight decay: the weights stay bit-identical through the window. ``qk`` is ``W_Q, W_K``
  (and ``b_Q, b_K``) of the head, ``ov`` is ``W_V, W_O`` (and ``b_V``).
- **graft**: at ``from_step`` the heads' weights (a whole layer's, norm gain and ``b_O`` included,
  for a name like ``L0``) are copied from a saved step of another run's ``trajectory/``, then,
  with ``frozen``, held there until ``until_step``.

What was resolved at ``from_step`` (a chosen head, a graft done, the frozen values) is in the
checkpoint (:meth:`state_dict`) and in ``RUN_DIR/intervention.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from data.probe import ProbeBatch
from metrics.heads.behaviour import behaviour_scores, behaviour_targets
from models.interventions import CHOSEN, Intervention, describe, head_name, named_heads
from models.transformer import AttentionOnlyTransformer
from records.layout import INTERVENTION_RECORD
from records.trajectory import Trajectory

CIRCUIT_WEIGHTS = {"qk": ("W_Q", "W_K", "b_Q", "b_K"), "ov": ("W_V", "W_O", "b_V")}
LAYER_WEIGHTS = ("norm.weight", "b_O")  # a whole layer's graft also takes these (where the model has them)


def head_weights(model: AttentionOnlyTransformer, layer: int, circuit: str) -> list[str]:
    """The parameter names (``layers.0.W_Q``) holding ``circuit`` (qk, ov, both) of a head of ``layer``,
    each indexed by head on its first axis."""
    names = CIRCUIT_WEIGHTS["qk"] + CIRCUIT_WEIGHTS["ov"] if circuit == "both" else CIRCUIT_WEIGHTS[circuit]
    params = dict(model.named_parameters())
    return [f"layers.{layer}.{n}" for n in names if f"layers.{layer}.{n}" in params]


def choose_head(model: AttentionOnlyTransformer, probe: ProbeBatch, score: str) -> tuple[int, int]:
    """The head with the highest ``score`` (prev_token, induction: the behaviours previous_token and
    induction, :mod:`metrics.heads.behaviour`) on ``probe`` now (layer 0 is excluded for induction when the
    model has more than one layer: no head of it can do induction)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(probe.tokens.to(model.W_E.device), head_out=False)
    finally:
        model.train(was_training)
    patterns = torch.stack(cache["pattern"]).float().cpu()  # (L, b, h, t, t)
    behaviour = "previous_token" if score == "prev_token" else "induction"
    bos_id = int(probe.tokens[0, 0]) if probe.first_start else None
    scores = behaviour_scores(patterns, behaviour_targets(probe.tokens.cpu(), bos_id, [behaviour]))[..., 0]
    if behaviour == "induction" and scores.shape[0] > 1:
        scores[0] = float("-inf")
    flat = int(scores.flatten().argmax())
    return divmod(flat, scores.shape[1])


class Interventions(L.Callback):
    """Applies a run's interventions (``plan``) on schedule; ``probe`` chooses heads named by score.

    Must come before the tracker among the callbacks: it sets the changes of a step before the
    tracker measures that step."""

    def __init__(self, plan: list[Intervention], probe: ProbeBatch, run_dir: Path | None = None) -> None:
        self.plan = plan
        self.probe = probe
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.heads: dict[int, list[tuple[int, int]]] = {}  # resolved heads, by index in the plan
        self.grafted: set[int] = set()
        self.frozen: dict[int, dict[str, Tensor]] = {}  # by index: parameter name -> its frozen value
        self.step: int | None = None  # the step whose changes are set

    def state_dict(self) -> dict:
        return {
            "heads": {n: [list(h) for h in heads] for n, heads in self.heads.items()},
            "grafted": sorted(self.grafted),
            "frozen": {n: dict(values) for n, values in self.frozen.items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.heads = {int(n): [tuple(h) for h in heads] for n, heads in state_dict.get("heads", {}).items()}
        self.grafted = set(state_dict.get("grafted", []))
        self.frozen = {int(n): dict(values) for n, values in state_dict.get("frozen", {}).items()}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.apply(pl_module.model, trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for param, index, _ in self.frozen_slices(pl_module.model):
            if param.grad is not None:
                param.grad[index] = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.restore_frozen(pl_module.model)
        self.apply(pl_module.model, trainer.global_step)  # the next step's changes, before the tracker measures it

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write_record()

    def frozen_now(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """``[(index, heads)]`` of the freezing interventions active at the step being trained."""
        step = self.step
        return [
            (n, self.heads[n])
            for n, i in enumerate(self.plan)
            if step is not None and i.freezes and i.active(step) and n in self.frozen
        ]

    @staticmethod
    def _index(name: str, head: int):
        """Where head ``head``'s part of parameter ``name`` is: its first axis, or all of a layer's own weight."""
        return slice(None) if name.endswith(LAYER_WEIGHTS) else head

    def frozen_slices(self, model) -> list[tuple[Tensor, object, Tensor]]:
        """``[(parameter, index, frozen value)]`` of every slice frozen at the step being trained."""
        params = dict(model.named_parameters())
        return [
            (params[name], self._index(name, head), value[self._index(name, head)])
            for n, heads in self.frozen_now()
            for name, value in self.frozen[n].items()
            for layer, head in heads
            if name.startswith(f"layers.{layer}.")
        ]

    @torch.no_grad()
    def restore_frozen(self, model: AttentionOnlyTransformer) -> None:
        for param, index, value in self.frozen_slices(model):
            param[index] = value

    @torch.no_grad()
    def apply(self, model: AttentionOnlyTransformer, step: int) -> None:
        """Resolve what starts at ``step`` (chosen heads, grafts, frozen values), then set the
        forward-pass changes active at ``step`` on ``model``."""
        self.step = step
        started = False
        for n, intervention in enumerate(self.plan):
            if not intervention.active(step):
                continue
            if n not in self.heads:
                self.heads[n] = self.resolve(model, intervention)
                started = True
            if intervention.kind == "graft" and n not in self.grafted:
                self.graft(model, intervention, self.heads[n])
                self.grafted.add(n)
            if intervention.freezes and n not in self.frozen:
                self.frozen[n] = self.freeze_values(model, intervention, self.heads[n])
        by_layer: dict[int, list] = {}
        for n, intervention in enumerate(self.plan):
            if intervention.active(step):
                for layer, changes in intervention.changes(self.heads[n]).items():
                    by_layer.setdefault(layer, []).extend(changes)
        model.set_changes(by_layer)
        if started:
            self.write_record()
            print(f"intervention from step {step}: {self.description()}")

    def resolve(self, model: AttentionOnlyTransformer, intervention: Intervention) -> list[tuple[int, int]]:
        heads: list[tuple[int, int]] = []
        for name in intervention.heads:
            found = [choose_head(model, self.probe, CHOSEN[name])] if name in CHOSEN else named_heads(name, model.shape)
            heads.extend(h for h in found if h not in heads)
        return heads

    def freeze_values(self, model, intervention: Intervention, heads: list[tuple[int, int]]) -> dict[str, Tensor]:
        """A copy of every parameter holding a frozen slice (only the heads' slices are written back)."""
        circuit = intervention.circuit if intervention.kind == "freeze" else "both"
        params = dict(model.named_parameters())
        names = {name for layer, _ in heads for name in head_weights(model, layer, circuit)}
        if intervention.kind == "graft":
            whole = [layer for layer, _ in heads if self._whole(intervention, layer)]
            names |= {f"layers.{layer}.{w}" for layer in whole for w in LAYER_WEIGHTS} & set(params)
        return {name: params[name].detach().clone() for name in sorted(names)}

    @staticmethod
    def _whole(intervention: Intervention, layer: int) -> bool:
        return f"L{layer}" in intervention.heads

    def graft(self, model, intervention: Intervention, heads: list[tuple[int, int]]) -> None:
        """Copy the heads' weights (a named layer's own weights too) from the source run's step."""
        source = Trajectory(intervention.source)
        step = intervention.source_step if intervention.source_step is not None else source.steps[-1]
        weights = source.state_dict(step)
        params = dict(model.named_parameters())
        for layer, head in heads:
            for name in head_weights(model, layer, "both"):
                params[name][head].copy_(weights[name][head])
            if self._whole(intervention, layer):
                for w in LAYER_WEIGHTS:
                    name = f"layers.{layer}.{w}"
                    if name in params:
                        params[name].copy_(weights[name])

    def description(self) -> str:
        return describe(self.plan, {n: [head_name(*h) for h in heads] for n, heads in self.heads.items()})

    def write_record(self) -> None:
        """``RUN_DIR/intervention.json``: each intervention, its heads as resolved, its window."""
        if self.run_dir is None:
            return
        record = {
            "description": self.description(),
            "interventions": [
                {
                    "label": i.label([head_name(*h) for h in self.heads[n]] if n in self.heads else None),
                    "kind": i.kind,
                    "heads": [head_name(*h) for h in self.heads.get(n, [])],
                    "named": list(i.heads),
                    "from_step": i.from_step,
                    "until_step": i.until_step,
                }
                for n, i in enumerate(self.plan)
            ],
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / INTERVENTION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
