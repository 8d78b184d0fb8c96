"""The W&B run a config asks for, without Lightning: its mode, id, name, group and tags, the
``wandb.init`` options of a run, and the run opened on a thread of its own while the process goes
on importing Lightning and building the run (``wandb.init`` takes ~1.5 s, most of it waiting on W&B's
service process: off the start's critical path, see :class:`WandbOpening`)."""

from __future__ import annotations

import os
import secrets
import string
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from conf.objects import intervention_plan
from records.layout import RUN_KEY, SWEEP_CONFIG, resume_checkpoint, resumed_run_dir
from records.wandb_lean import lean_wandb
from records.wandb_reach import effective_mode


def wandb_mode(cfg: DictConfig) -> str:
    """The config's mode if set, else ``$WANDB_MODE``, else offline (no account or network needed)."""
    mode = cfg.logger.wandb.mode
    return mode.value if mode is not None else os.environ.get("WANDB_MODE", "offline")


@dataclass(frozen=True)
class Continuation:
    """What a run continues: nothing, or a checkpoint; in place (same directory, CSV and W&B run) when
    ``resume`` names the run directory itself."""

    checkpoint: Path | None = None
    step: int = 0  # the checkpoint's global step: the first step this run logs
    in_place: bool = False
    wandb_id: str | None = None  # the W&B run to continue (in place only)

    @classmethod
    def of(cls, cfg: DictConfig, run_dir: Path) -> Continuation:
        if cfg.resume is None:
            return cls()
        checkpoint = resume_checkpoint(cfg.resume)
        state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
        in_place = resumed_run_dir(cfg.resume) == Path(run_dir).resolve()
        record = state.get(RUN_KEY) or {}
        return cls(checkpoint, int(state["global_step"]), in_place, record.get("wandb_id") if in_place else None)


def new_wandb_id() -> str:
    """A fresh W&B run id, chosen here so that checkpoints can record it before W&B starts; under a
    W&B sweep agent, the run id the agent assigned (``$WANDB_RUN_ID``)."""
    if os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


@dataclass(frozen=True)
class WandbNaming:
    group: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = ()


WANDB_TAG_LENGTH = 64  # W&B refuses longer tags


def wandb_naming(cfg: DictConfig, overrides: list[str], sweep_dir: str | None = None) -> WandbNaming:
    """A run's W&B group, name and tags, where ``logger.wandb`` leaves them unset: a sweep's jobs
    share the sweep directory as their group; a run is named by its command-line overrides, which
    are also its tags (``seed=1``, ``model.n_heads=4``), besides the config's own tags and one per
    training-time intervention (``intervention:ablate[L0H0] zero steps 0-end``)."""
    wandb_cfg = cfg.logger.wandb
    shown = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/", "logger.", "resume"))]
    kinds = [f"intervention:{i.label()}"[:WANDB_TAG_LENGTH] for i in intervention_plan(cfg)]
    tags = tuple(dict.fromkeys([*wandb_cfg.tags, *kinds, *(o[:WANDB_TAG_LENGTH] for o in shown)]))
    swept = keys_swept_by(Path(sweep_dir)) if sweep_dir else set()
    named = [o for o in shown if o.lstrip("+~").split("=", 1)[0] in swept] or shown
    return WandbNaming(
        group=wandb_cfg.group or (str(sweep_dir) if sweep_dir else None),
        name=wandb_cfg.name or (" ".join(named) or None),
        tags=tags,
    )


SWEEP_SYNTAX = ("choice(", "range(", "interval(", "glob(", "tag(", "shuffle(", "sort(")


def keys_swept_by(sweep_dir: Path) -> set[str]:
    """The keys a sweep varies, from the ``multirun.yaml`` Hydra writes before it launches the jobs:
    its overrides with several values (``seed=0,1``, ``range(...)``), and an optimizing sweeper's params."""
    try:
        master = OmegaConf.load(sweep_dir / SWEEP_CONFIG)
    except (FileNotFoundError, OSError):
        return set()
    keys = {
        o.lstrip("+~").split("=", 1)[0]
        for o in master.hydra.overrides.task
        if "=" in o and ("," in o.split("=", 1)[1] or o.split("=", 1)[1].startswith(SWEEP_SYNTAX))
    }
    params = OmegaConf.select(master, "hydra.sweeper.params") or {}
    return keys | set(params)


def report_run_options(cfg: DictConfig, save_dir: Path, **run) -> dict:
    """The ``wandb.init`` arguments of an analysis's or a sweep report's W&B run in ``save_dir``: the
    config's project and entity, its mode (online only if the server answers, else offline with one
    warning line: ``records/wandb_reach.py``), and the W&B run's own arguments in ``run`` (name, group,
    job_type, ...)."""
    w = cfg.logger.wandb
    mode = effective_mode(wandb_mode(cfg), w.connect_timeout_s, save_dir)
    return dict(project=w.project, entity=w.entity, dir=str(save_dir), mode=mode, **run)


def wandb_init_options(
    cfg: DictConfig,
    save_dir: Path,
    continuation: Continuation,
    wandb_id: str | None,
    naming: WandbNaming = WandbNaming(),
    several_runs: bool = False,
) -> dict:
    """The ``wandb.init`` arguments of a training run's W&B run in ``save_dir`` (a new one, or the one it
    continues in place): the config's project and entity, its mode (online only if the server
    answers, else offline with one warning line: ``records/wandb_reach.py``), its naming and config.
    ``several_runs``: this process holds other runs' W&B runs at the same time (an ensemble's members)."""
    w = cfg.logger.wandb
    return dict(
        project=w.project,
        entity=w.entity,
        dir=str(save_dir),
        mode=effective_mode(wandb_mode(cfg), w.connect_timeout_s, save_dir),
        group=naming.group,
        tags=list(naming.tags or w.tags),
        name=naming.name or w.name,
        id=wandb_id,
        resume="allow" if continuation.in_place else None,
        config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        **({"reinit": "create_new"} if several_runs else {}),
    )


class WandbOpening:
    """``wandb.init(**options)`` on a daemon thread, started at once: :meth:`run` waits for the W&B run
    and returns it, or raises what ``wandb.init`` raised. A run opens its W&B run so before it imports
    Lightning (seconds of CPU, while ``wandb.init`` mostly waits on W&B's service process), and its
    logger takes the run from here (``records.wandb_log.SectionedWandbLogger``)."""

    latest: WandbOpening | None = None  # the last one started in this process

    def __init__(self, options: dict) -> None:
        self.options = options
        self._run = self._error = None
        self._thread = threading.Thread(target=self._open, name="wandb-init", daemon=True)
        self._thread.start()
        WandbOpening.latest = self

    @classmethod
    def settle(cls) -> None:
        """Wait for the last W&B run still opening (what became of it aside): a run that fails while W&B
        opens ends the W&B run it opened, not one still half open."""
        if cls.latest is not None:
            cls.latest._thread.join()
            cls.latest = None

    def _open(self) -> None:
        import wandb

        lean_wandb()
        try:
            self._run = wandb.init(**self.options)
        except BaseException as error:  # handed to the thread that waits for the run
            self._error = error

    def run(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._run


def open_wandb_run(
    cfg: DictConfig, run_dir: Path, continuation: Continuation, naming: WandbNaming
) -> WandbOpening | None:
    """A single run's W&B run (the one it continues in place, or a new id), opening from now on; None
    with ``logger.wandb.enabled=false``."""
    if not cfg.logger.wandb.enabled:
        return None
    wandb_id = continuation.wandb_id or new_wandb_id()
    return WandbOpening(wandb_init_options(cfg, run_dir, continuation, wandb_id, naming))
