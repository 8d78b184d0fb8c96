"""The local learning coefficient during training, every N steps (``stages.llc.every_n_steps``)."""

from __future__ import annotations

import random
import time

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

from metrics.dynamics.llc import SGLDSettings, estimate_llc


class LLCEstimates(L.Callback):
    """After every ``every_n_steps``-th optimizer step (and the last), λ̂ of the model being trained
    (:func:`metrics.dynamics.llc.estimate_llc` on ``rows [n, seq]``, held-out sequences of the
    training distribution), logged as ``llc/mean``, ``llc/std`` (across chains), ``llc/drift`` and
    ``llc/settled`` at that step. devinterp seeds the global RNGs; they are restored afterwards, so
    training draws what it would have drawn without the estimate. The first estimate prints its cost."""

    def __init__(self, settings: SGLDSettings, rows: torch.Tensor, every_n_steps: int, settle_tolerance: float) -> None:
        self.settings, self.rows = settings, rows
        self.every_n_steps, self.settle_tolerance = every_n_steps, settle_tolerance
        self.reported = False

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps and step != trainer.max_steps:
            return
        started = time.perf_counter()
        states = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[pl_module.device] if pl_module.device.type == "cuda" else []):
            estimate = estimate_llc(pl_module.model, self.rows.to(pl_module.device), self.settings)
        random.setstate(states[0])
        np.random.set_state(states[1])
        metrics = {
            "llc/mean": estimate.mean,
            "llc/std": estimate.std,
            "llc/drift": estimate.drift,
            "llc/settled": float(estimate.settled(self.settle_tolerance)),
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if not self.reported:
            self.reported = True
            seconds = time.perf_counter() - started
            count = trainer.max_steps // self.every_n_steps
            print(
                f"llc: λ̂ {estimate.mean:.2f} ± {estimate.std:.2f} at step {step} took {seconds:.1f} s;"
                f" about {count * seconds:.0f} s for the run's {count} estimates",
                flush=True,
            )
