"""Every problem of a config before anything heavy is built: the schema's types (Hydra), each
section's values (its dataclass's ``problems()``: conf/schema.py, and the task's, each tracked
quantity's and measure's own), and what depends on several sections or on this machine."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from conf.objects import (
    build_probe,
    from_config,
    intervention_plan,
    model_shape,
    n_random,
    quantity_options,
    task_of,
    trajectory_events,
)
from conf.schema import LoggerConfig, ModelConfig, StagesConfig, TrainerConfig, TrajectoryConfig, upgraded
from data.reference_predictors import HELD_OUT_STRATEGY_IDS
from data.task import Task, tasks
from metrics.composition.measures import MEASURES
from metrics.dynamics.forecast import Forecaster, shape_of
from metrics.tracked.base import tracked_quantities
from metrics.tracked.options import TrackerOptions
from models.interventions import HEAD_NAME, Intervention
from models.optimizer import OptimizerSettings
from models.transformer import TransformerShape
from records.ensemble_checkpoint import member_record
from records.keys import flatten
from records.layout import CHECKPOINTS, LAST_CHECKPOINT, RUN_KEY, resume_checkpoint
from records.trajectory import HEADER_BYTES, Trajectory, TrajectoryError, TrajectoryPlan


class ConfigError(ValueError):
    """A config that type-checks but cannot run; the message says which keys and why."""


WANDB_ENV_MODES = ("offline", "online", "disabled", "dryrun", "run", "shared")
"""What W&B takes from ``$WANDB_MODE`` (it validates the variable when a run starts, deep in it)."""
RESUME_KEPT = (
    "seed",
    "model",
    "data",
    "optim",
    "tracker",
    "intervention",
)  # what a resume may not change unless allowed


def schema_defaults(sections: tuple[str, ...] = RESUME_KEPT, task: str = "repeated") -> dict[str, object]:
    """The schema's default of every key of ``sections``, flat (``model.biases``: False); ``data``'s
    are those of ``task``."""
    from conf.schema import Config, InterventionConfig, ModelConfig, TrackerConfig, task_node

    nodes = {"model": ModelConfig, "tracker": TrackerConfig, "intervention": InterventionConfig}
    root = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True, throw_on_missing=False)
    tree = {
        k: OmegaConf.to_container(OmegaConf.structured(nodes[k]), enum_to_str=True) if k in nodes else root.get(k)
        for k in sections
    }
    if "data" in sections and task in tasks():
        tree["data"] = OmegaConf.to_container(task_node(tasks()[task]), enum_to_str=True)
    return flatten(tree)


def config_changes(trained: dict, now: dict, sections: tuple[str, ...] = RESUME_KEPT) -> list[str]:
    """``key: trained -> now`` for every key of ``sections`` in the current config that differs between
    two resolved configs. A key the trained config lacks (an option added since) counts as its schema
    default; one the current config lacks (an option of an earlier version, or of another task) is not compared."""
    defaults = schema_defaults(sections, (now.get("data") or {}).get("name", "repeated"))
    trained = upgraded(trained)  # an earlier version's keys in this version's
    before = {**defaults, **flatten({k: trained.get(k) for k in sections})}
    after = flatten({k: now.get(k) for k in sections})
    return [f"{key}: {before.get(key)!r} -> {after[key]!r}" for key in sorted(after) if before.get(key) != after[key]]


def resume_problems(cfg: DictConfig, ensemble: bool = False) -> list[str]:
    """A resume checkpoint must load safely, belong to a run of this config, and stop short of
    ``trainer.max_steps`` (else nothing would train).

    ``resume`` names a run directory (its ``checkpoints/last.ckpt``) or a checkpoint file. Loaded
    weights-only: a checkpoint is data, and a pickle that would run code is refused, never run.
    """
    path = cfg.resume
    file = resume_checkpoint(path)
    if Path(path).is_dir() and not file.is_file():
        return [f"resume={path}: the directory holds no {CHECKPOINTS}/{LAST_CHECKPOINT} (nothing to resume)"]
    if not file.is_file():
        return [f"resume={path}: no such checkpoint file or run directory"]
    if file.stat().st_size == 0:
        return [f"resume={path}: the file is empty"]
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, foreign, or carrying code: all refused the same way
        if isinstance(error, pickle.UnpicklingError):
            reason = "not a torch checkpoint, or it holds objects a weights-only load refuses (code is never run)"
        else:
            reason = (str(error).strip().splitlines() or [""])[0][:160]
        return [f"resume={path}: not a loadable checkpoint ({type(error).__name__}: {reason})"]
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "global_step" not in checkpoint:
        return [f"resume={path}: not a checkpoint of this project (no state_dict and global_step)"]
    problems = []
    if not ensemble and member_record(checkpoint) is not None:
        return [
            f"resume={path} is a member of an ensemble (its optimizer state is the ensemble's): continue it"
            " with its sweep's command (hydra/launcher=ensemble), which resumes every member"
        ]
    step = checkpoint["global_step"]
    if step >= cfg.trainer.max_steps:
        problems.append(f"resume={path} is at step {step}: raise trainer.max_steps above it to train further")
    if not cfg.resume_allow_changes:
        trained = (checkpoint.get(RUN_KEY) or {}).get("config")
        if trained is None:
            problems.append(
                f"resume={path}: the checkpoint does not carry its run's config, so a change cannot be ruled out"
                " (resume_allow_changes=true resumes it anyway)"
            )
        else:
            now = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
            changes = config_changes(trained, now)
            if changes:
                shown = "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else "")
                problems.append(
                    f"resume={path} was trained with a different config ({shown}): pass the run's own"
                    " overrides again, or resume_allow_changes=true to change them"
                )
    return problems


def every_key() -> list[str]:
    """Every dotted key a config can have: the schema's sections', and ``data.*`` of every task."""
    import typing

    from conf.schema import Config, TrackerConfig, task_node

    tree = {}
    for name, kind in typing.get_type_hints(Config).items():
        node = TrackerConfig if name == "tracker" else kind
        structured = dataclasses.is_dataclass(node)
        tree[name] = OmegaConf.to_container(OmegaConf.structured(node), enum_to_str=True) if structured else None
    keys = set(flatten({k: v for k, v in tree.items() if k != "data"}))
    for task in tasks().values():
        keys |= set(flatten({"data": OmegaConf.to_container(task_node(task), enum_to_str=True)}))
    return sorted(keys)


def did_you_mean(key: str) -> str:
    """``" (did you mean data.batch_size?)"`` for the one key closest to a misspelt ``key``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(key, every_key(), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys under ``node`` that its schema does not define: ``+trainer.max_step=10`` adds one without
    a word from Hydra, and a misspelt option would otherwise change nothing."""
    import dataclasses

    from conf.schema import Config

    schema = Config if prefix == "" else OmegaConf.get_type(node)  # Hydra's composed root is a plain dict
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    found = []
    for key in node:
        if prefix == "" and key == "hydra":
            continue
        if known is not None and key not in known:
            found.append(f"{prefix}{key}")
        elif OmegaConf.is_dict(child := node._get_node(key)) and not child._is_missing() and not child._is_none():
            found += unknown_keys(child, f"{prefix}{key}.")
    return found


def non_finite_floats(node, prefix: str = "") -> list[str]:
    """``key=value`` for every float option that is NaN or infinite."""
    if OmegaConf.is_dict(node):
        return [
            bad for key in node if key != "hydra" for bad in non_finite_floats(node._get_node(key), f"{prefix}{key}.")
        ]
    if OmegaConf.is_list(node):
        return [bad for i, item in enumerate(node) for bad in non_finite_floats(node._get_node(i), f"{prefix}{i}.")]
    value = node._value() if not node._is_missing() else None
    return [f"{prefix.rstrip('.')}={value}"] if isinstance(value, float) and not math.isfinite(value) else []


def wandb_environment_problem() -> str | None:
    """One line when ``$WANDB_MODE`` is set to what W&B refuses (empty, as ``export WANDB_MODE=$MODE``
    leaves it with MODE unset, or a misspelling), else None: W&B reads it when its run starts, whatever
    the config's mode, and fails there, deep inside a run or an analysis."""
    mode = os.environ.get("WANDB_MODE")
    if mode is None or mode in WANDB_ENV_MODES:
        return None
    return (
        f"WANDB_MODE={mode!r} in the environment is not a W&B mode: unset it, or set it to offline, online or"
        " disabled (W&B reads it whatever logger.wandb.mode says)"
    )


def config_problems(cfg: DictConfig, multirun: bool = False, ensemble: bool = False) -> list[str]:
    """Every problem found in ``cfg``, as one readable sentence each (empty when it can run): each
    section's own (its dataclass's ``problems()``), then what depends on several; a check that
    needs another section's values runs once those are fine."""
    problems = []
    if unknown := unknown_keys(cfg):
        problems.append(
            f"unknown option{'s' * (len(unknown) > 1)} {', '.join(sorted(unknown))} (not in the schema, conf/schema.py; a typo?)"
        )
    if non_finite := non_finite_floats(cfg):
        problems.append(f"{', '.join(non_finite)}: need a finite number")
    model, trainer = from_config(ModelConfig, cfg.model), from_config(TrainerConfig, cfg.trainer)
    problems += model.problems()
    problems += data_problems(cfg)
    if n_random(cfg) < 2:
        problems.append(
            f"model.d_vocab={cfg.model.d_vocab} leaves {n_random(cfg)} random tokens (BOS takes one); need >= 2"
        )
    problems += [f"optim.{problem}" for problem in from_config(OptimizerSettings, cfg.optim).problems()]
    problems += trainer.problems()
    if multirun and trainer.devices > 1:
        problems.append(
            "a multirun (-m) with trainer.devices > 1 is not supported: Lightning re-launches DDP workers with the sweep's arguments"
        )
    if (problem := accelerator_problem(trainer.accelerator)) is not None:
        problems.append(problem)
    logger = from_config(LoggerConfig, cfg.logger)
    problems += logger.problems()
    if logger.wandb.enabled and (problem := wandb_environment_problem()):
        problems.append(problem)
    if cfg.resume is not None:
        problems += resume_problems(cfg, ensemble)
    model_ok = not model.problems()
    if cfg.tracker.enabled:
        problems += tracker_problems(cfg, probe=model_ok)
    if cfg.trajectory.enabled:
        own = from_config(TrajectoryConfig, cfg.trajectory).problems()
        problems += own if own or not model_ok or trainer.max_steps < 1 else trajectory_budget_problems(cfg)
    problems += from_config(StagesConfig, cfg.stages).problems()
    if model_ok and trainer.max_steps >= 1:
        problems += intervention_problems(cfg)
    return problems


def intervention_problems(cfg: DictConfig) -> list[str]:
    """Each intervention's problems on this model (``models/interventions.py``) and, for a graft, its
    source: a run with a trajectory holding the step, whose model has the grafted heads' shapes."""
    node = OmegaConf.to_container(cfg.intervention, resolve=True, enum_to_str=True)
    for entry, where in [(node, "intervention"), *((e, "intervention.also") for e in node.get("also") or [])]:
        if str(entry.get("kind", "none")) == "none" and entry.get("heads"):
            return [
                f"{where}.heads={entry['heads']} is set but no intervention is chosen:"
                " pick one (intervention=ablate, clamp_prev_token, ...; kind: ... in an also entry)"
            ]
    plan = intervention_plan(cfg)
    shape = model_shape(cfg)
    problems = [p for intervention in plan for p in intervention.problems(shape, cfg.trainer.max_steps)]
    if not problems:
        problems.extend(p for i in plan if i.kind == "graft" and (p := graft_source_problem(i, shape)))
    return problems


def graft_source_problem(intervention: Intervention, shape: TransformerShape) -> str | None:
    """Why ``intervention``'s source cannot give its heads' weights to a model of ``shape`` (None: it can)."""
    where = f"intervention.source={intervention.source}"
    try:
        source = Trajectory(intervention.source)
        step = intervention.source_step if intervention.source_step is not None else source.steps[-1]
        source.check(step)
    except (TrajectoryError, IndexError) as error:
        return f"{where}: {error}"
    other = source.shape
    for key in ("d_model", "d_head", "normalization", "biases"):
        if getattr(other, key) != getattr(shape, key):
            return f"{where}: its model has {key}={getattr(other, key)}, this one {getattr(shape, key)}: the weights do not fit"
    for name in intervention.heads:
        match = HEAD_NAME.match(name)
        layer, head = int(match[1]), int(match[2] or 0)
        if layer >= other.n_layers or head >= other.n_heads:
            return f"{where}: its model has no head {name} ({other.n_layers} layers of {other.n_heads} heads)"
        if match[2] is None and other.n_heads != shape.n_heads:
            return f"{where}: grafting layer {name} needs the same heads per layer ({other.n_heads} there, {shape.n_heads} here)"
    return None


def data_problems(cfg: DictConfig) -> list[str]:
    """The task's problems (:meth:`data.task.Task.problems`), once ``data.name`` is the task the data
    group chose."""
    chosen = OmegaConf.get_type(cfg.data)
    if isinstance(chosen, type) and issubclass(chosen, Task) and cfg.data.name != chosen.name:
        return [
            f"data.name={cfg.data.name!r}: the task is chosen by the data group, data=NAME (data={chosen.name} here)"
        ]
    if cfg.data.name not in tasks():
        return [f"data.name={cfg.data.name!r}: no such task; choose one of data={', data='.join(tasks())}"]
    return task_of(cfg).problems(n_random(cfg), cfg.model.n_ctx)


def llc_calibration_warning(cfg: DictConfig) -> str | None:
    """One line when the LLC's SGLD settings were calibrated on a model of another size (the step and
    the pull that keep chains near w* change with it: docs/results.md, "Developmental stages")."""
    model, llc = cfg.model, cfg.stages.llc
    size = [model.n_layers, model.n_heads, model.d_model, model.d_head]
    if size == list(llc.calibrated_on):
        return None
    shown = lambda sizes: "×".join(map(str, sizes))
    return (
        f"warning: stages.llc's lr={llc.lr:g} and localization={llc.localization:g} were calibrated on a"
        f" {shown(llc.calibrated_on)} model (layers×heads×d_model×d_head), this one is {shown(size)}:"
        f" check them with python -m analysis.calibrate_llc RUN_DIR"
    )


def trajectory_budget_problems(cfg: DictConfig) -> list[str]:
    """Whether ``trajectory.budget_mb`` holds the steps the trajectory must keep of this model."""
    t = cfg.trajectory
    itemsize = 8 if cfg.trainer.precision in ("64", "64-true") else 4
    adaptive = cfg.tracker.enabled and t.trigger.value != "none"
    try:
        TrajectoryPlan.fit(
            cfg.trainer.max_steps,
            t.log_steps,
            t.every_n_steps,
            model_shape(cfg).parameter_count * itemsize + HEADER_BYTES,
            None if t.budget_mb is None else int(t.budget_mb * 2**20),
            adaptive,
            trajectory_events(cfg),
        )
    except ValueError as error:
        return [f"trajectory.budget_mb={t.budget_mb}: {error}; raise it, or trajectory.enabled=false"]
    return []


def tracker_problems(cfg: DictConfig, probe: bool = True) -> list[str]:
    """Problems of ``cfg.tracker`` (an enabled tracker): the tracker's own options', every tracked
    quantity's and measure's (their ``problems()``), every schedule's against the snapshots', and
    (``probe``: once the model is known to be fine) whether the task's probe fits the model."""
    model, trainer, tracker = cfg.model, cfg.trainer, cfg.tracker
    own = from_config(TrackerOptions, tracker)
    problems = own.problems()
    owners = {**tracked_quantities(), **MEASURES}
    for name, options in quantity_options(tracker).items():
        root = getattr(owners[name], "root_options", False)
        prefix = "tracker." if root else f"tracker.{name}."
        problems += [prefix + problem for problem in (options.problems() if hasattr(options, "problems") else [])]
        schedules = (
            {"": options} if not root else {f"{f.name}.": getattr(options, f.name) for f in dataclasses.fields(options)}
        )
        for key, schedule in schedules.items():
            every = getattr(schedule, "every_n_steps", 0)
            if every > 0 and own.every_n_steps >= 1 and every % own.every_n_steps:
                problems.append(
                    f"{prefix}{key}every_n_steps={every} must be a multiple of tracker.every_n_steps={own.every_n_steps}"
                    " (what it measures is measured at snapshots)"
                )
    strategies = quantity_options(tracker).get("strategies")
    if strategies is not None and strategies.every_n_steps > 0 and strategies.sequences >= 2 and not data_problems(cfg):
        ids = np.arange(HELD_OUT_STRATEGY_IDS, HELD_OUT_STRATEGY_IDS + strategies.sequences)
        problems += task_of(cfg).strategy_problems(ids, n_random(cfg))
    if (
        probe
        and (own.probe_n is None or own.probe_n >= 2)
        and own.probe_batch_size >= 1
        and (own.probe_positions is None or own.probe_positions >= 1)
        and not data_problems(cfg)
    ):
        probe_len = build_probe(cfg).tokens.shape[-1]
        if probe_len > model.n_ctx:
            problems.append(
                f"tracker.probe_n={tracker.probe_n} makes a probe of {probe_len} tokens > model.n_ctx={model.n_ctx}"
            )
    if own.forecaster is not None:
        problems += forecaster_problems(cfg, own.forecaster)
    if not cfg.logger.csv:
        problems.append("tracker.enabled needs logger.csv=true: the end-of-run figure is drawn from the CSV log")
    if resolved_accelerator(trainer.accelerator) == "mps":
        if own.precision == "float64":
            problems.append(
                "tracker.precision=float64 is not available on MPS (no float64 there): use tracker.precision=model"
            )
        if trainer.precision in ("64-true", "64"):
            problems.append(f"trainer.precision={trainer.precision} is not available on MPS (no float64 there)")
    return problems


def forecaster_problems(cfg: DictConfig, path: str) -> list[str]:
    """Whether ``tracker.forecaster=path`` is a forecaster for this run's task and model shape."""
    try:
        forecaster = Forecaster.load(Path(path))
    except ValueError as error:
        return [f"tracker.forecaster={error}"]
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if why := forecaster.refusal(str(cfg.data.name), shape_of(model)):
        return [f"tracker.forecaster={path} is not for this run: {why}"]
    return []


def resolved_accelerator(accelerator: str) -> str:
    """The device kind Lightning runs ``trainer.accelerator`` on here: ``gpu`` and ``auto`` take CUDA
    where torch sees it, else Apple's MPS where it is available (``auto``: else the CPU)."""
    if accelerator in ("gpu", "auto"):
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu" if accelerator == "auto" else "none"
    return accelerator


def accelerator_problem(accelerator: str) -> str | None:
    """Why ``trainer.accelerator`` cannot run on this machine, or None."""
    resolved = resolved_accelerator(accelerator)
    if resolved == "none":
        return "trainer=gpu but torch sees no GPU here (no CUDA device, no Apple MPS): use trainer=cpu"
    if resolved == "cuda" and not torch.cuda.is_available():
        return "trainer.accelerator=cuda but no CUDA device is visible to torch (use trainer=cpu)"
    if resolved == "mps" and not torch.backends.mps.is_available():
        return "trainer.accelerator=mps but Apple's MPS is not available here (use trainer=cpu)"
    return None


def validate(cfg: DictConfig, multirun: bool = False, ensemble: bool = False) -> None:
    """Raise :class:`ConfigError` listing every problem in ``cfg`` (``ensemble``: a member of an
    ensemble, which may resume an ensemble member's checkpoint)."""
    problems = config_problems(cfg, multirun, ensemble)
    if problems:
        raise ConfigError("; ".join(problems))


def stages_problems(stages: DictConfig) -> list[str]:
    """Every problem of the ``stages`` section (the analyses of developmental stages check it alone)."""
    return from_config(StagesConfig, stages).problems()
