"""An ensemble's members as runs: each member's own callbacks and loggers, driven by one trainer.

One Lightning trainer trains the stacked model (:class:`models.ensemble_module.EnsembleLM`);
:class:`EnsembleMembers` hands every hook on to each member's own callbacks (the tracker, the weight
trajectory, the end-of-run report, the LLC estimates: the very objects a single run uses, built by
``runtime.build.build_callbacks`` from the member's config) with a :class:`MemberTrainer` and a
:class:`MemberModule` in place of the trainer and the module, so that each sees one run: its own
model (views of its slice of the stacked weights), its loss, its loggers and its checkpoint.

A member's interventions (``callbacks.interventions``) set their head changes on its view; the dispatcher
hands them to the stacked model after every hook that may change them, and before the optimizer step
it gives each view its slice of the gradients (so that a freeze zeroes the member's own).

What a single run's other callbacks do is done here, per member: the divergence guard (a diverged
member is stopped and recorded as failed, the others go on), a member's own stop (its callback sets
``should_stop``: it finishes at that step, the others go on), ``train/loss`` logged at Lightning's
steps, the checkpoints (one file per member, ``records.ensemble_checkpoint``), the progress lines,
and the stop on a signal (:class:`EnsembleStop`: every member checkpointed at the same step).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import Logger

from callbacks.preemption import Preempted, StopOnSignal
from models.ensemble_transformer import member_views
from records.ensemble_checkpoint import save_atomically, split_member


def reads_gradients(callback: L.Callback) -> bool:
    """Whether ``callback`` has an ``on_before_optimizer_step`` of its own (the one hook that sees the gradients)."""
    return type(callback).on_before_optimizer_step is not L.Callback.on_before_optimizer_step


@dataclass
class Member:
    """One run of an ensemble: its directory, loggers, callbacks and checkpoint record; ``ended``:
    why it stopped before the others (a divergence), as the message its status records."""

    index: int
    run_dir: Path
    loggers: list[Logger]
    callbacks: list[L.Callback]
    record: dict  # checkpoint[RUN_KEY]: its config, W&B id and place in the ensemble
    checkpoint: Path
    ended: str | None = None
    ended_step: int | None = None
    saved_step: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # time in its own callbacks, by their class
    active: bool = field(default=True)
    done: bool = False  # its own callback asked to stop (``should_stop``): it finishes at this step

    def timed(self, callback: L.Callback, hook: str, *args) -> None:
        """``callback.hook(*args)``, its time added to :attr:`seconds`."""
        started = time.perf_counter()
        getattr(callback, hook)(*args)
        name = type(callback).__name__
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


class MemberModule:
    """What a member's callbacks see as the LightningModule: its model (``model``, an
    ``AttentionOnlyTransformer`` of views), its parameters, device and step."""

    def __init__(self, ensemble: L.LightningModule, model: torch.nn.Module) -> None:
        self.ensemble, self.model = ensemble, model

    @property
    def device(self) -> torch.device:
        return self.ensemble.device

    @property
    def global_step(self) -> int:
        return self.ensemble.global_step

    def parameters(self):
        return self.model.parameters()


class MemberTrainer:
    """What a member's callbacks see as the trainer: the ensemble's trainer, with the member's
    loggers, and ``save_checkpoint`` writing the member's own checkpoint."""

    def __init__(
        self, trainer: L.Trainer, member: Member, save: Callable[[Member], None], clock: Callable[[], float]
    ) -> None:
        self._trainer, self._member, self._save, self._clock = trainer, member, save, clock

    @property
    def training_clock(self) -> float:
        """The member's training seconds so far: its share of the ensemble's steps (every member's
        callbacks left out), what the tracker's cost report sets its own cost against."""
        return self._clock()

    @property
    def loggers(self) -> list[Logger]:
        return self._member.loggers

    @property
    def logger(self) -> Logger | None:
        return self._member.loggers[0] if self._member.loggers else None

    def save_checkpoint(self, filepath, weights_only: bool = False, storage_options=None) -> None:
        self._save(self._member)

    @property
    def should_stop(self) -> bool:
        return self._trainer.should_stop or self._member.done

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        """A member's own callback ends its run (``tracker.stop_after_phase_change``): the member finishes
        at this step and the others train on (:meth:`EnsembleMembers.finish`)."""
        if value:
            self._member.done = True

    def __getattr__(self, name: str):
        return getattr(self._trainer, name)


class EnsembleMembers(L.Callback):
    """Hands every hook to each active member's callbacks (see the module docstring), and does per
    member what a single run's divergence guard, loss logging, checkpoints and progress lines do."""

    def __init__(
        self, members: list[Member], checkpoint_every_n_steps: int, progress_every_n_steps: int | None
    ) -> None:
        self.members = members
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.progress_every_n_steps = progress_every_n_steps
        self.proxies: list[tuple[MemberTrainer, MemberModule]] = []
        self.training_seconds = 0.0
        self.gradient_readers: set[int] = set()  # the members with a callback that reads gradients
        self._step_started: float | None = None
        self._progress: tuple[int, float] | None = None
        self.trainer: L.Trainer | None = None
        self._dumped: tuple[int, dict] | None = None  # (step, the trainer's checkpoint of that step)

    # ---- the members' hooks ------------------------------------------------------------------
    def active(self) -> list[Member]:
        return [m for m in self.members if m.active]

    def each(self, hook: str, *args, members: list[Member] | None = None) -> None:
        """Call ``hook`` on every callback of each active member (or of ``members``), timed per member."""
        for member in self.active() if members is None else members:
            trainer, module = self.proxies[member.index]
            for callback in member.callbacks:
                member.timed(callback, hook, trainer, module, *args)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trainer = trainer
        views = member_views(pl_module.model)  # now: the weights have their device and dtype
        self.proxies = [
            (MemberTrainer(trainer, m, self.save, self.member_share), MemberModule(pl_module, views[m.index]))
            for m in self.members
        ]
        self.gradient_readers = {m.index for m in self.members if any(reads_gradients(c) for c in m.callbacks)}
        self.each("on_train_start")
        self.set_changes(pl_module)
        self._progress = (trainer.global_step, time.perf_counter())

    def member_share(self) -> float:
        """A member's share of the training time so far (seconds): the ensemble's, over its active members."""
        return self.training_seconds / max(1, len(self.active()))

    def set_changes(self, pl_module: L.LightningModule) -> None:
        """Every member's interventions now active (set on its view by its own callback) onto the stacked model."""
        pl_module.model.set_changes([[layer.changes for layer in module.model.layers] for _, module in self.proxies])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """The members' own hook (a freeze zeroes its slices' gradients here), each view holding its slice
        of the stacked gradients for the call (views: what it writes, the ensemble's gradients get)."""
        readers = [m for m in self.active() if m.index in self.gradient_readers]
        stacked = dict(pl_module.model.named_parameters())
        for member in readers:
            for name, p in self.proxies[member.index][1].model.named_parameters():
                p.grad = None if stacked[name].grad is None else stacked[name].grad[member.index]
        try:
            self.each("on_before_optimizer_step", optimizer, members=readers)
        finally:
            for member in readers:
                for p in self.proxies[member.index][1].model.parameters():
                    p.grad = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._step_started is not None:
            self.training_seconds += time.perf_counter() - self._step_started
        losses = self.check_divergence(trainer, pl_module)
        step = trainer.global_step
        for member in self.active():
            trainer_k, module_k = self.proxies[member.index]
            loss_k, batch_k = pl_module.losses[member.index], batch[member.index]
            for callback in member.callbacks:
                member.timed(callback, "on_train_batch_end", trainer_k, module_k, loss_k, batch_k, batch_idx)
        self.set_changes(pl_module)  # the next step's, set by the members' interventions
        if trainer.log_every_n_steps > 0 and step % trainer.log_every_n_steps == 0:
            for member in self.active():  # Lightning's own rule and step for a run's train/loss
                for logger in member.loggers:
                    logger.log_metrics(
                        {"train/loss": losses[member.index], "epoch": trainer.current_epoch}, step=step - 1
                    )
                    logger.save()  # as Lightning does after logging: a killed run keeps its CSV so far
        if step % self.checkpoint_every_n_steps == 0:
            for member in self.active():
                self.save(member)
        for member in [m for m in self.active() if m.done]:
            self.finish(member, trainer, pl_module)
        self.progress(trainer, step, losses)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.each("on_train_end")
        for member in self.active():
            if member.saved_step != trainer.global_step:  # the last step is always checkpointed
                self.save(member)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.each("on_fit_end")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.proxies:
            self.each("teardown", stage, members=self.members)

    # ---- per member: divergence, checkpoints, progress -------------------------------------------
    def check_divergence(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[float]:
        """Each member's loss and largest weight, read in one host sync; a member with either not
        finite is stopped (:meth:`stop`). Returns the losses."""
        n = len(self.members)
        weights = torch.stack([p.detach().reshape(n, -1).abs().amax(dim=1) for p in pl_module.model.parameters()])
        dtype = torch.promote_types(pl_module.losses.dtype, torch.float32)  # the loss as logged: its own precision
        values = torch.cat([pl_module.losses.to(dtype), weights.amax(dim=0).to(dtype)]).tolist()
        losses, largest = values[:n], values[n:]
        for member in self.active():
            loss = losses[member.index]
            if not (math.isfinite(loss) and math.isfinite(largest[member.index])):
                what = f"loss {loss:g}" if not math.isfinite(loss) else "non-finite weights"
                self.stop(member, trainer, pl_module, f"training diverged at step {trainer.global_step}: {what}")
        return losses

    def stop(self, member: Member, trainer: L.Trainer, pl_module: L.LightningModule, why: str) -> None:
        """Stop ``member`` (the others train on): its callbacks are not called again, its last finite
        checkpoint stays, and ``member.ended`` says why (its status and W&B run record it: ``runtime.ensemble_job``)."""
        member.active = False
        pl_module.stop(member.index)
        kept = (
            f"the last finite checkpoint is {member.checkpoint}"
            if member.checkpoint.is_file()
            else "no checkpoint was written before it"
        )
        member.ended, member.ended_step = f"error: {why}; {kept}", trainer.global_step
        print(f"member {member.index} ({member.run_dir}): {member.ended}; the others go on", file=sys.stderr)
        if not self.active():
            trainer.should_stop = True

    def finish(self, member: Member, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """End ``member``'s run at this step as a finished run, as a single run ends when a callback sets
        ``trainer.should_stop``: its checkpoint, its callbacks' ``on_train_end`` and ``on_fit_end`` (its
        report), then it trains no more; the ensemble stops when no member trains."""
        if member.saved_step != trainer.global_step:
            self.save(member)
        self.each("on_train_end", members=[member])
        self.each("on_fit_end", members=[member])
        member.active = False
        pl_module.stop(member.index)
        if not self.active():
            trainer.should_stop = True

    def save(self, member: Member) -> None:
        """Member ``member``'s checkpoint at this step (``records.ensemble_checkpoint``); the trainer's
        state is dumped once per step for every member saved at it."""
        step = self.trainer.global_step
        if self._dumped is None or self._dumped[0] != step:
            self._dumped = (step, self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
        checkpoint = split_member(self._dumped[1], member.index, member.record, self.member_states(member))
        save_atomically(checkpoint, member.checkpoint)
        member.saved_step = step

    def progress(self, trainer: L.Trainer, step: int, losses: list[float]) -> None:
        """``step N/M  loss mean (min-max) over K members  (T ms/step)`` every ``progress_every_n_steps``."""
        every = self.progress_every_n_steps
        if not every or step % every or self._progress is None or step == self._progress[0]:
            return
        active = [losses[m.index] for m in self.active()]
        if not active:
            return
        last_step, last_time = self._progress
        now = time.perf_counter()
        mean = sum(active) / len(active)
        print(
            f"step {step}/{trainer.max_steps}  loss {mean:.4f} ({min(active):.4f}-{max(active):.4f})"
            f" over {len(active)} members  ({1000 * (now - last_time) / (step - last_step):.1f} ms/step)",
            flush=True,
        )
        self._progress = (step, now)

    # ---- checkpointed state -----------------------------------------------------------------
    @staticmethod
    def member_states(member: Member) -> dict:
        """The states of ``member``'s callbacks, by their state keys (as Lightning checkpoints a run's)."""
        return {c.state_key: state for c in member.callbacks if (state := c.state_dict())}

    def state_dict(self) -> dict:
        return {"members": [self.member_states(m) for m in self.members]}

    def load_state_dict(self, state_dict: dict) -> None:
        for member, states in zip(self.members, state_dict.get("members", [])):
            for callback in member.callbacks:
                if callback.state_key in states:
                    callback.load_state_dict(states[callback.state_key])


class EnsembleStop(StopOnSignal):
    """:class:`~callbacks.preemption.StopOnSignal` for an ensemble: on a stop signal, every active
    member is checkpointed at the end of the step in progress; the next step raises :class:`Preempted`."""

    def __init__(self, members: EnsembleMembers) -> None:
        super().__init__(Path(members.members[0].checkpoint))
        self.ensemble = members

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.received is not None and self.saved_step is None:
            for member in self.ensemble.active():
                self.ensemble.save(member)
            self.saved_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.saved_step is not None:
            raise Preempted(self.received, self.saved_step, self.checkpoint)
