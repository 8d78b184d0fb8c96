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

import json
import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from conf.console_log import StartupErrors, tee_console
from conf.run_dir import CHECKPOINTS, LAST_CHECKPOINT
from callbacks.run_status import FAILED, FINISHED, PREEMPTED, RUNNING, read_status, write_status
from conf.schema import register_schemas
from conf.slurm import remember_slurm_run, requeue_this_job
from conf.validate import ConfigError, validate

register_schemas()


def resume_command(run_dir: Path) -> str:
    """The command that continues this run in place: this run's overrides, with ``resume=RUN_DIR``."""
    overrides = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+~") != "resume"]
    return " ".join(["python train.py", *overrides, f"resume={run_dir}"])


class JobEnded(Exception):
    """A run that ended without finishing: ``exit_code`` and a one-line ``message`` for the console."""

    def __init__(self, exit_code: int, message: str, status: str = FAILED, step: int | None = None) -> None:
        super().__init__(message)
        self.exit_code, self.status, self.step = exit_code, status, step
        self.announced = False

    def announce(self, run_dir: Path) -> None:
        """Record the ending in ``status.json`` and print it, once."""
        if not self.announced:
            write_status(run_dir, self.status, self.exit_code, self.step, str(self))
            print(self, file=sys.stderr)
            self.announced = True


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Train one run. A single run that fails exits non-zero; a sweep's job returns its exit code
    instead, so that the other jobs still run (the sweep's report marks it, and exits non-zero)."""
    startup_errors.release()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with tee_console(run_dir / "train.log"):  # the report, warnings and errors, also in the run directory
        return run_job(cfg, run_dir)


def run_job(cfg: DictConfig, run_dir: Path) -> float:
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        if multirun and not prepare_sweep_job(cfg, run_dir):  # finished by an earlier launch of the same sweep
            return objective_value(cfg, run_dir) if cfg.objective else 0
        write_status(run_dir, RUNNING)
        train(cfg, run_dir)
    except JobEnded as ended:
        ended.announce(run_dir)
        if not multirun or ended.status == PREEMPTED:
            sys.exit(ended.exit_code)  # a stopped sweep stops: the same command again resumes it
        return float("nan") if cfg.objective else ended.exit_code  # NaN: a failed trial, to Optuna
    except Exception as error:
        write_status(run_dir, FAILED, 1, error=f"{type(error).__name__}: {error}")
        if not multirun:
            raise
        traceback.print_exc()
        return float("nan") if cfg.objective else 1
    write_status(run_dir, FINISHED)
    return objective_value(cfg, run_dir) if cfg.objective else 0


def objective_value(cfg: DictConfig, run_dir: Path) -> float:
    """What an optimizing sweeper (``hydra/sweeper=optuna``) minimizes or maximizes: ``cfg.objective``,
    a key of the run's ``summary.json`` (``final/loss/repeated``) or of its config (``model.d_model``).
    NaN (a failed trial, to Optuna) when the key is missing, or when ``objective_cliff_by`` is set and
    the repeated-token loss shows no cliff by that step."""
    from callbacks.figure import SUMMARY_NAME

    summary_path = run_dir / SUMMARY_NAME
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if cfg.objective_cliff_by is not None:
        midpoint = summary.get("phase_change/loss_midpoint_step")
        if midpoint is None or midpoint > cfg.objective_cliff_by:
            print(f"objective: NaN (no loss cliff by step {cfg.objective_cliff_by}; midpoint {midpoint})")
            return float("nan")
    value = summary.get(cfg.objective, OmegaConf.select(cfg, cfg.objective))
    print(f"objective {cfg.objective} = {value}")
    return float("nan") if value is None else float(value)


def prepare_sweep_job(cfg: DictConfig, run_dir: Path) -> bool:
    """Validate a sweep job (a single run was validated before Hydra wrote anything); when an earlier
    launch of the same sweep left this job's directory, resume it in place, or skip it if it finished.
    Returns whether the job is to run."""
    earlier = read_status(run_dir)
    if earlier is not None and earlier["status"] == FINISHED and cfg.resume is None:
        print(f"job {HydraConfig.get().job.num} finished in an earlier launch of this sweep: skipped ({run_dir})")
        return False
    if earlier is not None and cfg.resume is None and (run_dir / CHECKPOINTS / LAST_CHECKPOINT).is_file():
        with open_dict(cfg):
            cfg.resume = str(run_dir)  # interrupted: continue from its last checkpoint
    try:
        validate(cfg, multirun=True)
    except ConfigError as error:
        raise JobEnded(1, f"config error: {error}") from None
    return True


def train(cfg: DictConfig, run_dir: Path) -> None:
    import lightning as L  # Lightning and W&B load only once the config is known to be good
    import torch
    import wandb

    from callbacks.divergence import TrainingDiverged
    from callbacks.preemption import Preempted
    from conf.build import Continuation, build_datamodule, build_module, build_trainer, torch_threads, wandb_naming

    # Lightning prints to the console itself; Hydra's root handler would print every line twice
    logging.getLogger("lightning.pytorch").propagate = False
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    continuation = Continuation.of(cfg, run_dir)
    if continuation.checkpoint is not None:
        where = "in place" if continuation.in_place else f"into {run_dir}"
        print(f"resuming {continuation.checkpoint} at step {continuation.step}, {where}")
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    threads = torch_threads(cfg, hydra_cfg.launcher if multirun else None)
    if threads is not None:
        torch.set_num_threads(threads)
    sweep_dir = hydra_cfg.sweep.dir if multirun else None
    if not multirun:
        remember_slurm_run(run_dir)  # a sweep's job finds its directory again by its number
    try:
        trainer = build_trainer(cfg, run_dir, continuation, wandb_naming(cfg, list(hydra_cfg.overrides.task), sweep_dir))
        trainer.fit(build_module(cfg), datamodule=build_datamodule(cfg), ckpt_path=continuation.checkpoint, weights_only=True)
    except Preempted as stop:
        if wandb.run is not None:
            wandb.run.mark_preempting()
        wandb.finish(exit_code=stop.exit_code)  # marked preempted/failed, never successful
        ended = JobEnded(stop.exit_code, f"stopped by {stop.signum.name} at step {stop.step}; checkpoint: {stop.checkpoint};"
                         f" continue with: {resume_command(run_dir)}", PREEMPTED, stop.step)
        ended.announce(run_dir)
        requeued, said = requeue_this_job()
        if said:
            print(said, file=sys.stderr)
        if requeued:  # leave as submitit does: no result for this attempt, the requeued one gives it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(stop.exit_code)
        raise ended from None
    except TrainingDiverged as error:
        wandb.finish(exit_code=1)  # the W&B run is marked failed, not finished
        last = run_dir / CHECKPOINTS / LAST_CHECKPOINT
        kept = f"the last finite checkpoint is {last}" if last.is_file() else "no checkpoint was written before it"
        raise JobEnded(1, f"error: {error}; {kept}") from None
    except BaseException:
        wandb.finish(exit_code=1)  # any other failure (a second Ctrl-C too): never reported as success
        raise
    wandb.finish()


startup_errors = StartupErrors()  # Hydra's report of a bad command line, held to be told in one line

if __name__ == "__main__":
    with startup_errors:
        main()
