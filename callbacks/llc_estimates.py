"""The local learning coefficient during training, every N steps (``stages.llc.every_n_steps``)."""

from __future__ import annotations

import random
import time

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

from metrics.dynamics.llc import SGLDSettings, llc_record
from models.ensemble import standalone


class LLCEstimates(L.Callback):
    """After every ``every_n_steps``-th optimizer step (and the last), λ̂ of the model being trained
    (:func:`metrics.dynamics.llc.estimate_llc` on ``rows [n, seq]``, held-out sequences of the
    training distribution), logged as ``llc/mean``, ``llc/std`` (across chains), ``llc/drift``,
    ``llc/settled`` and ``llc/diverged`` at that step (a diverged chain: NaN and a warning; training
    goes on). devinterp seeds the global RNGs; they are restored afterwards, so training draws what
    it would have drawn without the estimate. The first estimate prints its cost. An ensemble member's
    model (views of the stacked weights) is sampled through a copy of its own (``models.ensemble.standalone``)."""

    def __init__(self, settings: SGLDSettings, rows: torch.Tensor, every_n_steps: int, settle_tolerance: float) -> None:
        self.settings, self.rows = settings, rows
        self.every_n_steps, self.settle_tolerance = every_n_steps, settle_tolerance
        self.reported = False
        self.last_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last_step = trainer.global_step  # a resumed run's first step was estimated before it stopped

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        due = step > 0 and (step % self.every_n_steps == 0 or step == trainer.max_steps)
        if not due or step == self.last_step:
            return  # gradient accumulation calls us several times per optimizer step
        self.last_step = step
        started = time.perf_counter()
        states = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[pl_module.device] if pl_module.device.type == "cuda" else []):
            record = llc_record(
                standalone(pl_module.model), self.rows.to(pl_module.device), self.settings, self.settle_tolerance
            )
        random.setstate(states[0])
        np.random.set_state(states[1])
        metrics = {f"llc/{key}": record[key] for key in ("mean", "std", "drift", "settled", "diverged")}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if record["diverged"]:
            print(
                f"llc: warning: an SGLD chain diverged at step {step} (logged as NaN): lower stages.llc.lr or"
                " raise stages.llc.localization",
                flush=True,
            )
        elif not self.reported:
            self.reported = True
            seconds = time.perf_counter() - started
            count = trainer.max_steps // self.every_n_steps
            print(
                f"llc: λ̂ {record['mean']:.2f} ± {record['std']:.2f} at step {step} took {seconds:.1f} s;"
                f" about {count * seconds:.0f} s for the run's {count} estimates",
                flush=True,
            )
