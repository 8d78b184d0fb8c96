"""Train an attention-only transformer and track head composition over training.

    python train.py                                  # the default experiment (phase_change)
    python train.py experiment=one_layer             # the one-layer control
    python train.py -m model.n_heads=2,4 seed=0,1    # a sweep: one W&B run per job
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: with anything else running on the cores (another
# job, a sweep), spinning threads slow batched linear algebra down 100-fold (see the README, "Threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from conf.schema import register_schemas
from conf.validate import ConfigError, validate

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg, multirun=HydraConfig.get().mode == RunMode.MULTIRUN)
    except ConfigError as error:
        sys.exit(f"config error: {error}")

    import lightning as L  # Lightning and W&B load only once the config is known to be good
    import wandb

    from conf.build import build_datamodule, build_module, build_trainer

    # Lightning prints to the console itself; Hydra's root handler would print every line twice
    logging.getLogger("lightning.pytorch").propagate = False
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    from callbacks.divergence import TrainingDiverged

    try:
        trainer = build_trainer(cfg, run_dir)
        trainer.fit(build_module(cfg), datamodule=build_datamodule(cfg), ckpt_path=cfg.resume)
    except TrainingDiverged as error:
        wandb.finish(exit_code=1)  # the W&B run is marked failed, not finished
        last = run_dir / "checkpoints" / "last.ckpt"
        kept = f"the last finite checkpoint is {last}" if last.is_file() else "no checkpoint was written before it"
        sys.exit(f"error: {error}; {kept}")
    finally:
        wandb.finish()  # one W&B run per job, also when a job fails


if __name__ == "__main__":
    main()
