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

from conf.console_log import StartupErrors, tee_console
from conf.schema import register_schemas
from conf.slurm import remember_slurm_run, requeue_this_job
from conf.validate import ConfigError, validate

register_schemas()


def resume_command(run_dir: Path) -> str:
    """The command that continues this run in place: this run's overrides, with ``resume=RUN_DIR``."""
    overrides = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") != "resume"]
    return " ".join(["python train.py", *overrides, f"resume={run_dir}"])


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    startup_errors.release()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    tee_console(run_dir / "train.log")  # the report, warnings and errors, also in the run directory
    if HydraConfig.get().mode == RunMode.MULTIRUN:  # a single run was validated before Hydra wrote anything
        try:
            validate(cfg, multirun=True)
        except ConfigError as error:
            sys.exit(f"config error: {error}")

    import lightning as L  # Lightning and W&B load only once the config is known to be good
    import wandb

    from callbacks.divergence import TrainingDiverged
    from callbacks.preemption import Preempted
    from conf.build import Continuation, build_datamodule, build_module, build_trainer

    # Lightning prints to the console itself; Hydra's root handler would print every line twice
    logging.getLogger("lightning.pytorch").propagate = False
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    remember_slurm_run(run_dir)
    continuation = Continuation.of(cfg, run_dir)
    if continuation.checkpoint is not None:
        where = "in place" if continuation.in_place else f"into {run_dir}"
        print(f"resuming {continuation.checkpoint} at step {continuation.step}, {where}")
    try:
        trainer = build_trainer(cfg, run_dir, continuation)
        trainer.fit(build_module(cfg), datamodule=build_datamodule(cfg), ckpt_path=continuation.checkpoint, weights_only=True)
    except Preempted as stop:
        if wandb.run is not None:
            wandb.run.mark_preempting()
        wandb.finish(exit_code=stop.exit_code)  # marked preempted/failed, never successful
        print(f"stopped by {stop.signum.name} at step {stop.step}; checkpoint: {stop.checkpoint};"
              f" continue with: {resume_command(run_dir)}", file=sys.stderr)
        requeued = requeue_this_job()  # last: SLURM ends this process as it requeues the job
        if requeued:
            print(requeued, file=sys.stderr)
        sys.exit(stop.exit_code)
    except TrainingDiverged as error:
        wandb.finish(exit_code=1)  # the W&B run is marked failed, not finished
        last = run_dir / "checkpoints" / "last.ckpt"
        kept = f"the last finite checkpoint is {last}" if last.is_file() else "no checkpoint was written before it"
        sys.exit(f"error: {error}; {kept}")
    except BaseException:
        wandb.finish(exit_code=1)  # any other failure (a second Ctrl-C too): never reported as success
        raise
    wandb.finish()


startup_errors = StartupErrors()  # Hydra's report of a bad command line, held to be told in one line

if __name__ == "__main__":
    with startup_errors:
        main()
