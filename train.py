"""Train an attention-only transformer and track head composition over training.

    python train.py                                  # the default experiment (phase_change)
    python train.py experiment=one_layer             # the one-layer control
    python train.py -m model.n_heads=2,4 seed=0,1    # a sweep: one W&B run per job

This file composes the config, builds the run and fits it; what each way of ending means (status,
exit code, SLURM requeue) is ``runtime/job.py``.
"""

from __future__ import annotations

import os
import sys

from runtime.collector import exit_uncollected, pause_for_start_up, resume_for_training
from runtime.threads import bounded_spinning

os.environ.update(bounded_spinning(os.environ))  # before torch loads (docs/operations.md, "Threads")
if __name__ == "__main__":
    pause_for_start_up(sys.argv[1:])  # Python's garbage collector off until training starts (runtime/collector.py)

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from conf.schema import register_schemas
from runtime.console import StartupErrors
from runtime.job import run_job, training_outcome

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    startup_errors.release()
    return run_job(cfg, fit)


def fit(cfg: DictConfig, run_dir: Path) -> None:
    from records.wandb_run import open_wandb_run
    from runtime.continuation import Continuation
    from runtime.naming import wandb_naming

    continuation = Continuation.of(cfg, run_dir)
    continuation.announce(run_dir)
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    naming = wandb_naming(cfg, list(hydra_cfg.overrides.task), hydra_cfg.sweep.dir if multirun else None)
    with training_outcome(run_dir, cfg.explorer) as page:
        opening = open_wandb_run(cfg, run_dir, continuation, naming)  # W&B opens its run while Lightning loads
        import lightning as L

        from runtime.build import build_datamodule, build_module, build_trainer
        from runtime.threads import set_torch_threads, torch_threads

        logging.getLogger("lightning.pytorch").propagate = False  # Lightning prints itself: not twice via Hydra
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        if (threads := torch_threads(cfg, hydra_cfg.launcher if multirun else None)) is not None:
            set_torch_threads(threads)
        trainer = build_trainer(cfg, run_dir, continuation, naming, opening, page.start if page else None)
        resume_for_training()
        trainer.fit(
            build_module(cfg), datamodule=build_datamodule(cfg), ckpt_path=continuation.checkpoint, weights_only=True
        )


startup_errors = StartupErrors()  # Hydra's report of a bad command line, held to be told in one line

if __name__ == "__main__":
    try:
        with startup_errors:
            main()
    finally:
        exit_uncollected()
