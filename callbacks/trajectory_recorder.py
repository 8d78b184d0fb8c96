"""Keep the weights over training: log-spaced steps, a linear grid, every tracker step through a
phase change, and the last step (``RUN_DIR/trajectory/``, :mod:`records.trajectory`).

The sparse grids follow the checkpoint schedules of the papers that analyse trajectories after
training (Hoogland et al. 2024: log-spaced ∪ linear steps). The dense part is adaptive: when the
tracker's curve starts to move (:class:`PhaseTrigger`), the weights of every tracker step are kept
until it has settled, so a later analysis sees the phase change at full resolution. The trigger
reads a trailing average and so fires a little late; the last ``look_back`` tracker steps' weights
are held in memory and written when it fires.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch

from records.layout import INDEX_NAME
from records.trajectory import (
    DEFAULT_BUDGET_MB,
    DEFAULT_BUDGET_STEPS,
    HEADER_BYTES,
    TrajectoryPlan,
    TrajectoryWriter,
)

TRIGGER_KEYS = {"repeated_loss": ("loss/repeated", True), "induction_score": ("heads/induction/top", False)}
"""Trigger name -> (the tracker key it reads, whether the change is a fall)."""


@dataclass
class PhaseTrigger:
    """Decides, tracker step by tracker step, whether a phase change is under way.

    It reads a trailing mean over ``window`` points of the tracked value (the repeated-token loss,
    falling, or the top induction score, rising). Calm: it starts when the mean has moved by
    ``threshold`` times the value's scale from its most extreme level since the last change ended
    (the scale: the loss at the first step, about ln d_vocab; the induction score lives in [0, 1], so
    1). Under way: it ends when, over the last ``window`` points, the mean moved less than
    ``settle`` times its whole move since the start."""

    falling: bool
    threshold: float
    settle: float
    window: int
    recent: list[float] = field(default_factory=list)  # the last `window` values
    means: list[float] = field(default_factory=list)  # trailing means since the current state began
    reference: float | None = None  # the extreme level since calm began (calm), or where the change started
    scale: float | None = None  # what `threshold` is a share of
    active: bool = False

    def update(self, value: float) -> bool:
        """Feed one tracker step's value; returns whether the change is under way at this step."""
        if not math.isfinite(value):
            return self.active
        self.recent = (self.recent + [value])[-self.window :]
        mean = sum(self.recent) / len(self.recent)
        toward = -1.0 if self.falling else 1.0  # the sign of the change's direction
        if self.scale is None:
            self.scale = abs(value) if self.falling else 1.0
        if not self.active:
            self.reference = mean if self.reference is None else (max if self.falling else min)(self.reference, mean)
            if toward * (mean - self.reference) >= self.threshold * self.scale:
                self.active, self.means = True, [mean]
            return self.active
        self.means.append(mean)
        if len(self.means) > self.window:
            recent_move = abs(mean - self.means[-1 - self.window])
            if recent_move < self.settle * abs(mean - self.reference):
                self.active, self.reference, self.means = False, mean, []
        return True  # the step that ends the change is still kept

    def state_dict(self) -> dict:
        return {
            "recent": self.recent,
            "means": self.means,
            "reference": self.reference,
            "scale": self.scale,
            "active": self.active,
        }

    def load_state_dict(self, state: dict) -> None:
        self.recent, self.means = list(state["recent"]), list(state["means"])
        self.reference, self.scale, self.active = state["reference"], state["scale"], state["active"]


class TrajectoryRecorder(L.Callback):
    """Writes the model's weights at the planned steps, and at every tracker step while ``trigger``
    says a phase change is under way (read from ``tracker.latest``); the last step always.

    Resume-safe: a run resumed in place forgets its steps after the checkpoint's and carries on
    with the trigger's state and the held-back weights from the checkpoint, so it keeps the same
    steps as an uninterrupted run, each once. Runs on global rank 0 only.
    """

    def __init__(
        self,
        directory: Path,
        config: dict,
        run: dict,
        max_steps: int,
        log_steps: int,
        every_n_steps: int,
        budget_mb: float | None,
        trigger: PhaseTrigger | None,
        tracker,
        look_back: int,
        events: tuple[int, ...] = (),
    ) -> None:
        """``events``: steps always kept, around the training-time interventions' window edges."""
        self.directory = Path(directory)
        self.config, self.run = config, run
        self.max_steps, self.log_steps, self.every_n_steps = max_steps, log_steps, every_n_steps
        self.events = events
        self.budget = None if budget_mb is None else int(budget_mb * 2**20)  # None: follows the model
        self.trigger, self.tracker = trigger, tracker
        self.held: deque[tuple[int, dict[str, torch.Tensor]]] = deque(maxlen=look_back if trigger else 0)
        self.writer: TrajectoryWriter | None = None
        self.plan: TrajectoryPlan | None = None
        self.last_step: int | None = None
        self.over_budget_from: int | None = None
        self.seconds = 0.0

    # --- Lightning hooks -------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        model = pl_module.model
        bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters()) + HEADER_BYTES
        self.plan = TrajectoryPlan.fit(
            trainer.max_steps,
            self.log_steps,
            self.every_n_steps,
            bytes_per_step,
            self.budget,
            adaptive=self.trigger is not None,
            events=self.events,
        )
        in_place = (self.directory / INDEX_NAME).is_file()
        self.writer = TrajectoryWriter(self.directory, model.shape, self.config, self.run)
        step = trainer.global_step
        if in_place:
            self.writer.truncate_after(step)  # a resumed run keeps nothing past its checkpoint
        print(self.plan_line())
        if step == 0 or not in_place:  # step 0, or the first step of a fork (resume=CHECKPOINT into a new directory)
            self.record(trainer, pl_module, step, force=not in_place and step > 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and self.writer is not None:
            self.record(trainer, pl_module, trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or self.writer is None:
            return
        step = trainer.global_step
        if str(step) not in self.writer.index["steps"]:
            start = time.perf_counter()
            self.save(step, pl_module, ["final"])
            self.seconds += time.perf_counter() - start
        print(self.summary_line())

    def state_dict(self) -> dict:
        return {
            "trigger": self.trigger.state_dict() if self.trigger else None,
            "last_step": self.last_step,
            "held": [(step, weights) for step, weights in self.held],
            "over_budget_from": self.over_budget_from,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if self.trigger is not None and state_dict.get("trigger") is not None:
            self.trigger.load_state_dict(state_dict["trigger"])
        self.last_step = state_dict.get("last_step")
        self.held.extend(state_dict.get("held", []))
        self.over_budget_from = state_dict.get("over_budget_from")

    # --- what to keep ---------------------------------------------------------------------------

    def record(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, force: bool = False) -> None:
        if step == self.last_step:
            return  # gradient accumulation calls us several times per optimizer step
        self.last_step = step
        start = time.perf_counter()
        self.keep(pl_module, step, force)
        self.seconds += time.perf_counter() - start

    def keep(self, pl_module: L.LightningModule, step: int, force: bool) -> None:
        """Write ``step`` if planned or under way, hold it back if it may belong to a change soon."""
        reasons = list(self.plan.steps.get(step, []))
        latest = getattr(self.tracker, "latest", None)
        if self.trigger is not None and latest is not None and latest[0] == step:
            key, _ = TRIGGER_KEYS[self.trigger_name]
            if self.trigger.update(float(latest[1].get(key, math.nan))):
                self.flush_held(pl_module)
                reasons.append("adaptive")
            elif not reasons:
                self.held.append((step, clone_weights(pl_module.model)))
        if force:
            reasons.append("start")
        if reasons and (set(reasons) != {"adaptive"} or self.fits(step)):
            self.save(step, pl_module, reasons)

    @property
    def trigger_name(self) -> str:
        return "repeated_loss" if self.trigger.falling else "induction_score"

    def flush_held(self, pl_module: L.LightningModule) -> None:
        """Write the held-back tracker steps: the trigger fired, so they belong to the change."""
        while self.held:
            step, weights = self.held.popleft()
            if str(step) not in self.writer.index["steps"] and self.fits(step):
                self.save(step, pl_module, ["adaptive"], weights)

    def fits(self, step: int) -> bool:
        """Whether an adaptive step fits the budget with every planned step still to come."""
        still_planned = sum(1 for s in self.plan.steps if s > step and str(s) not in self.writer.index["steps"])
        fits = self.writer.bytes + (1 + still_planned) * self.plan.bytes_per_step <= self.plan.budget
        if not fits and self.over_budget_from is None:
            self.over_budget_from = step
            print(
                f"trajectory: the budget of {self.plan.budget / 2**20:g} MB is reached at step {step}: later phase-change"
                " steps are not kept (raise trajectory.budget_mb)"
            )
        return fits

    def save(self, step: int, pl_module: L.LightningModule, reasons: list[str], weights: dict | None = None) -> None:
        self.writer.add(step, weights if weights is not None else pl_module.model.state_dict(), reasons)

    # --- what it says ---------------------------------------------------------------------------

    def plan_line(self) -> str:
        p = self.plan
        grids = [f"{p.log_steps} log-spaced"] + ([f"every {p.every_n_steps}"] if p.every_n_steps else [])
        if self.events:
            grids.append(f"{len(self.events)} around the interventions' windows")
        thinned = (
            " (thinned to fit the budget)"
            if (p.log_steps, p.every_n_steps) != (self.log_steps, self.every_n_steps)
            else ""
        )
        dense = f", every tracker step while the {self.trigger_name.replace('_', ' ')} moves" if self.trigger else ""
        return (
            f"trajectory: weights at {len(p.steps)} planned steps ({', '.join(grids)}{thinned}){dense};"
            f" {p.bytes_per_step / 2**20:.2f} MB each, at most {p.budget / 2**20:g} MB{self.budget_origin()}, in {self.directory}"
        )

    def budget_origin(self) -> str:
        """Why the budget is what it is, when it was not set and the model made it larger than the default."""
        if self.budget is not None or self.plan.budget <= DEFAULT_BUDGET_MB * 2**20:
            return ""
        return f" ({DEFAULT_BUDGET_STEPS} steps of this model: trajectory.budget_mb not set; setting it caps the disk used)"

    def summary_line(self) -> str:
        entries = self.writer.index["steps"]
        count = lambda reason: sum(reason in e["reasons"] for e in entries.values())
        adaptive = sorted(int(s) for s, e in entries.items() if "adaptive" in e["reasons"])
        span = f" (steps {adaptive[0]}-{adaptive[-1]})" if adaptive else ""
        return (
            f"trajectory: {len(entries)} steps kept: {count('log')} log-spaced, {count('linear')} linear,"
            f" {len(adaptive)} adaptive{span}; {self.writer.bytes / 2**20:.1f} MB; {self.seconds:.2f} s spent keeping them"
        )


def clone_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the model's weights (held back until the trigger decides)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
