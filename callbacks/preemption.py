"""Stop cleanly on SIGTERM, SIGINT (Ctrl-C) and SIGUSR1: checkpoint the step in progress, then stop.

SLURM, ``timeout`` and Kubernetes send SIGTERM; SLURM sends SIGUSR1 ahead of a time limit when asked
(``sbatch --signal=USR1@90``; submitit asks for SIGUSR2); a user presses Ctrl-C. Each one lets the step in progress finish (its
metrics and tracker snapshot logged), saves ``checkpoints/last.ckpt`` at that step, and raises
:class:`Preempted` before the next step starts, which Lightning passes through its exception path (every logger is finalized as
failed, the CSV flushed) to ``train.py``, which finishes the W&B run as preempted and exits non-zero.
A second Ctrl-C stops at once, without a checkpoint. A signal that came while the run started is
handed over by the handler replaced here (``runtime.job.StartupSignals``): the run stops after its
first step.

Lightning's own SIGTERM handling stops at the end of a step with exit code 0 and no checkpoint, and
its SLURM requeue saves a mid-step ``hpc_ckpt`` into a fixed root directory; both are replaced here
while training runs (from ``on_train_start``; Lightning restores the original handlers at teardown).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint

from records.status import STOP_SIGNALS


class Preempted(Exception):
    """Training stopped on a signal after checkpointing ``step`` to ``checkpoint``."""

    def __init__(self, signum: signal.Signals, step: int, checkpoint: Path) -> None:
        super().__init__(f"{signum.name} at step {step}: checkpoint saved to {checkpoint}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (SIGTERM: 143)."""
        return 128 + int(self.signum)


class StopOnSignal(Checkpoint):
    """Checkpoint at the end of the step during which a stop signal came, then raise :class:`Preempted`
    (a signal during the last step: the run simply finishes).

    A :class:`~lightning.pytorch.callbacks.Checkpoint` subclass, so Lightning runs it after every other
    callback: the step's tracker snapshot is logged before the checkpoint is written.
    """

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = Path(checkpoint)
        self.received: signal.Signals | None = None
        self.saved_step: int | None = None
        self._previous: dict[signal.Signals, object] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        # a signal that came while the run started: kept by the handler replaced here (a
        # runtime.job.StartupSignals, its ``noted``), or Lightning's SIGTERM flag where it had the handler
        starting = next((h for h in self._previous.values() if isinstance(getattr(h, "noted", None), list)), None)
        connector = getattr(trainer, "_signal_connector", None)
        if starting is not None and starting.noted:
            self.received = starting.noted[-1]
            starting.noted.clear()  # taken: a later part of the same launch starts afresh
        elif connector is not None and connector.received_sigterm:
            self.received = signal.SIGTERM
        if connector is not None:
            connector.received_sigterm = False  # ours to handle: a checkpoint, not Lightning's exception

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = signal.Signals(signum)
        # straight to the file descriptor: a signal that lands while the main thread is inside a
        # buffered write (a progress line into a full pipe) would make print() raise "reentrant call"
        os.write(
            sys.__stderr__.fileno(),
            f"\n{self.received.name} received: stopping after this step, with a checkpoint"
            f" (Ctrl-C again to stop at once, without one)\n".encode(),
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self.received is not None and self.saved_step is None:
            trainer.save_checkpoint(self.checkpoint)  # where ModelCheckpoint saves: a resume continues exactly
            self.saved_step = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        # stop here rather than at the end of the saved step: Lightning writes that step's logged
        # metrics (the loss) after the batch-end hooks, and they must reach every logger
        if self.saved_step is not None:
            raise Preempted(self.received, self.saved_step, self.checkpoint)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:  # not already handed back by Lightning's teardown
                signal.signal(signum, handler)
        self._previous = {}
