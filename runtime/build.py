"""A run built from its validated config: the datamodule, the module, the loggers, the callbacks and the trainer."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from callbacks.divergence import DivergenceGuard
from callbacks.final_report import FinalReport
from callbacks.interventions import Interventions
from callbacks.llc_estimates import LLCEstimates
from callbacks.phase_change_forecast import PhaseChangeForecast
from callbacks.phase_change_stop import StopAfterPhaseChange
from callbacks.preemption import StopOnSignal
from callbacks.progress import ProgressLines, loss_bar
from callbacks.run_record import RunRecord
from callbacks.tracker import CompositionTracker, tracker_from_config
from callbacks.trajectory_recorder import TRIGGER_KEYS, PhaseTrigger, TrajectoryRecorder
from conf.objects import (
    build_probe,
    build_sampler,
    from_config,
    intervention_plan,
    llc_sequences,
    model_shape,
    sgld_settings,
    task_of,
    trajectory_events,
)
from conf.validate import llc_calibration_warning
from data.datamodule import TokenDataModule
from metrics.dynamics.forecast import FORECAST_BEHAVIOURS, Forecaster, no_induction_circuit
from metrics.dynamics.phase_change import SMALLEST_PHASE_CHANGE
from models.interventions import silenced_throughout
from models.lit_module import InductionLM
from models.optimizer import OptimizerSettings
from records.checkpoint_writer import SameDirectoryCheckpointIO
from records.csv_log import ResumableCSVLogger
from records.keys import flatten
from records.layout import (
    CHECKPOINTS,
    LAST_CHECKPOINT,
    RUN_KEY,
    TRAJECTORY_DIR,
)
from records.wandb_log import SectionedWandbLogger, opened_logger
from records.wandb_run import WandbOpening, new_wandb_id, wandb_init_options
from runtime.continuation import Continuation
from runtime.naming import WandbNaming


def build_datamodule(cfg: DictConfig) -> TokenDataModule:
    return TokenDataModule(build_sampler(cfg), cfg.data.batch_size)


def build_module(cfg: DictConfig) -> InductionLM:
    model = cfg.model
    return InductionLM(
        model_shape(cfg), from_config(OptimizerSettings, cfg.optim), str(model.init.value), model.init_std
    )


def build_loggers(
    cfg: DictConfig,
    run_dir: Path,
    continuation: Continuation,
    wandb_id: str | None,
    naming: WandbNaming = WandbNaming(),
    several_runs: bool = False,
    opening: WandbOpening | None = None,
) -> list[Logger]:
    """The run's loggers: its W&B run (a new one, or the one it continues in place; ``opening``: the
    one already being opened, :class:`records.wandb_run.WandbOpening`, else opened now) and its CSV.
    ``several_runs``: this process holds other runs' W&B runs at the same time (an ensemble's members)."""
    loggers: list[Logger] = []
    if cfg.logger.wandb.enabled:
        if opening is not None:
            loggers.append(SectionedWandbLogger(opening.run(), opening.options["dir"]))
        else:  # an ensemble's members: one after another
            loggers.append(
                opened_logger(wandb_init_options(cfg, run_dir, wandb_id, continuation.in_place, naming, several_runs))
            )
    if cfg.logger.csv:
        loggers.append(ResumableCSVLogger(run_dir, resume_step=continuation.step if continuation.in_place else None))
    return loggers


def run_record(cfg: DictConfig, wandb_id: str | None) -> dict:
    """What every checkpoint of the run carries (``checkpoint[RUN_KEY]``): its resolved config and W&B run id."""
    return {RUN_KEY: {"config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "wandb_id": wandb_id}}


def build_callbacks(
    cfg: DictConfig,
    run_dir: Path,
    wandb_id: str | None,
    naming: WandbNaming = WandbNaming(),
    while_reporting: Callable[[], None] | None = None,
) -> list[L.Callback]:
    last = run_dir / CHECKPOINTS / LAST_CHECKPOINT
    record = run_record(cfg, wandb_id)
    config = record[RUN_KEY]["config"]
    callbacks: list[L.Callback] = [
        DivergenceGuard(),  # first: a diverged step is neither measured nor checkpointed
        RunRecord(record, last),
        ModelCheckpoint(
            dirpath=run_dir / CHECKPOINTS,
            save_last=True,
            save_top_k=0,
            enable_version_counter=False,
            every_n_train_steps=cfg.trainer.checkpoint_every_n_steps,
        ),
        StopOnSignal(last),  # a Checkpoint too: Lightning runs both after the tracker
    ]
    if plan := intervention_plan(cfg):  # before the tracker: it sets the changes of the step measured
        callbacks.append(Interventions(plan, build_probe(cfg), run_dir))
    tr = cfg.tracker
    tracker = tracker_from_config(cfg, run_dir) if tr.enabled else None
    if tracker is not None:
        callbacks.append(tracker)
    if cfg.trajectory.enabled:  # after the tracker: it reads the tracker's snapshot of the same step
        run = {"wandb_id": wandb_id, "wandb_group": naming.group, "wandb_name": naming.name}
        callbacks.append(build_trajectory(cfg, run_dir, config, run, tracker))
    if (
        tracker is not None and tr.forecast and task_of(cfg).reader_behaviour in FORECAST_BEHAVIOURS
    ):  # after the tracker
        silenced = silenced_throughout(intervention_plan(cfg), cfg.model.n_heads)
        if why := no_induction_circuit(cfg.model.n_layers, cfg.model.n_heads, silenced):
            print(f"forecast: none ({why})")
        else:
            callbacks.append(build_forecast(cfg, tracker))
    if tracker is not None and tr.stop_after_phase_change:  # after the tracker: it reads its snapshot
        callbacks.append(StopAfterPhaseChange(tracker, SMALLEST_PHASE_CHANGE, tr.smoothing_window))
    if tracker is not None:
        callbacks.append(FinalReport(run_dir, tr.smoothing_window, cfg.figures, while_reporting))
    llc = cfg.stages.llc
    if llc.every_n_steps > 0:
        if warning := llc_calibration_warning(cfg):
            print(warning, file=sys.stderr)
        rows = llc_sequences(cfg)
        callbacks.append(LLCEstimates(sgld_settings(llc), rows, llc.every_n_steps, llc.settle_tolerance, llc.heads))
    return callbacks


def build_forecast(cfg: DictConfig, tracker: CompositionTracker) -> PhaseChangeForecast:
    """The phase change's forecast: by ``tracker.forecaster`` (validated before the run), else the rule."""
    tr = cfg.tracker
    forecaster = Forecaster.load(Path(tr.forecaster)) if tr.forecaster else None
    settings = {k: str(v) for k, v in flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)).items()}
    return PhaseChangeForecast(tracker, cfg.trainer.max_steps, tr.smoothing_window, forecaster, settings)


def build_trajectory(
    cfg: DictConfig, run_dir: Path, config: dict, run: dict, tracker: CompositionTracker | None
) -> TrajectoryRecorder:
    """The weight trajectory as ``cfg.trajectory`` configures it; no adaptive part without a tracker."""
    trajectory = cfg.trajectory
    trigger = None
    if tracker is not None and trajectory.trigger.value != "none":
        _, falling = TRIGGER_KEYS[trajectory.trigger.value]
        trigger = PhaseTrigger(
            falling=falling, threshold=trajectory.threshold, settle=trajectory.settle, window=trajectory.window
        )
    return TrajectoryRecorder(
        run_dir / TRAJECTORY_DIR,
        config,
        run,
        cfg.trainer.max_steps,
        trajectory.log_steps,
        trajectory.every_n_steps,
        trajectory.budget_mb,
        trigger,
        tracker,
        trajectory.look_back,
        trajectory_events(cfg),
    )


def silence_known_warnings() -> None:
    """Two warnings every run printed that nobody can act on, each matched by message and module
    (every other warning is shown): Lightning 2.6's pytree helper tests ``isinstance(spec, LeafSpec)``,
    which torch 2.13 deprecates at every fit; and Lightning's hint to start with ``srun`` wherever
    SLURM is installed, which does not apply here: a run under ``sbatch`` (or submitit) is requeued
    by ``runtime/slurm.py`` itself, without ``srun`` (tests/runtime/test_slurm.py)."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    warnings.filterwarnings(
        "ignore",
        message=r"The `srun` command is available on your system but is not used",
        module=r"lightning\.fabric\.plugins\.environments\.slurm",
    )


def build_trainer(
    cfg: DictConfig,
    run_dir: Path,
    continuation: Continuation = Continuation(),
    naming: WandbNaming = WandbNaming(),
    opening: WandbOpening | None = None,
    while_reporting: Callable[[], None] | None = None,
) -> L.Trainer:
    """The trainer, its loggers and callbacks; the W&B run is the continued one or a new id, or the one
    ``opening`` is already opening (:func:`records.wandb_run.open_wandb_run`); ``while_reporting``: what
    the end-of-run report begins once its figures are being drawn (the explorer page's writing)."""
    silence_known_warnings()
    trainer = cfg.trainer
    interactive = sys.stdout.isatty()  # not a terminal: progress lines instead of a redrawn bar
    if opening is not None:
        wandb_id = opening.options["id"]
    else:
        wandb_id = (continuation.wandb_id or new_wandb_id()) if cfg.logger.wandb.enabled else None
    callbacks = build_callbacks(cfg, run_dir, wandb_id, naming, while_reporting)
    loggers = build_loggers(cfg, run_dir, continuation, wandb_id, naming, opening=opening)  # the W&B run open
    guard = next(c for c in callbacks if isinstance(c, DivergenceGuard))  # the one reader of the loss
    if trainer.enable_progress_bar:
        callbacks.append(loss_bar(guard) if interactive else ProgressLines(trainer.progress_every_n_steps, guard))
    return L.Trainer(
        default_root_dir=str(run_dir),
        gradient_clip_val=trainer.gradient_clip_val,
        enable_progress_bar=trainer.enable_progress_bar and interactive,
        logger=loggers or False,
        callbacks=callbacks,
        **trainer_loop(trainer),
    )


def trainer_loop(trainer: DictConfig) -> dict:
    """The ``L.Trainer`` arguments that ``cfg.trainer`` sets for a run and an ensemble alike: the steps,
    the device and precision, the logging period, and the SLURM plugin."""
    return dict(
        max_steps=trainer.max_steps,
        accelerator=trainer.accelerator,
        devices=trainer.devices,
        precision=trainer.precision,
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        log_every_n_steps=trainer.log_every_n_steps,
        deterministic=trainer.deterministic,
        enable_model_summary=False,
        # under SLURM the runtime requeues, with our checkpoint (runtime/slurm.py); Lightning's own
        # handler would also requeue a job whose warning signal comes after training has finished
        # a checkpoint written beside the last and renamed over it: a full disk leaves the last one whole
        plugins=[
            SameDirectoryCheckpointIO(),
            *([SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []),
        ],
    )
