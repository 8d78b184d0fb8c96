"""A run's W&B group, name and tags, from its config, its command line and the sweep it belongs to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from conf.objects import intervention_plan
from records.layout import SWEEP_CONFIG


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
