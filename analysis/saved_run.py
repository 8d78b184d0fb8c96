"""The request of an analysis over a finished run's saved weights, checked before any work: the
run's config with one section's overrides, the saved steps to read, the analysis's own options and
its output directory ``RUN_DIR/analysis/NAME/``. :mod:`analysis.protocol` runs it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from conf.schema import Config, typed_tracker, upgraded
from conf.validate import wandb_environment_problem
from models.interventions import HeadChange, Intervention, named_heads, plan_of
from records.layout import ANALYSIS_DIR, INTERVENTION_RECORD
from records.trajectory import Trajectory, describe_steps


class AnalysisError(ValueError):
    """A request that cannot run: the message says what is wrong, in one line."""


@dataclass(frozen=True)
class Request:
    """What to analyse: the run's config (with the overrides), which saved steps, the analysis's
    own options (its command-line flags), where."""

    run_dir: Path
    cfg: DictConfig
    overrides: tuple[str, ...]
    steps: list[int]
    name: str
    options: dict = field(default_factory=dict)
    device: str = "cpu"  # where the weights are loaded and measured

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def out_dir(self) -> Path:
        return self.run_dir / ANALYSIS_DIR / self.name


def run_config(trajectory: Trajectory, overrides: list[str], section: str | None, example: str = "") -> DictConfig:
    """The run's resolved config on the typed schema, with ``overrides`` applied; only ``SECTION.*``
    keys may change (the weights are fixed; no key when ``section`` is None). ``example`` is a valid
    override, for the error message."""
    saved = upgraded(trajectory.config)  # an earlier version's config in this version's keys
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), saved)
        cfg.tracker = typed_tracker(saved.get("tracker"))
    except OmegaConfBaseException as error:
        raise AnalysisError(f"the run's config does not fit this version's schema ({first_line(error)})") from None
    for override in overrides:
        if section is None:
            raise AnalysisError(f"{override!r}: this analysis takes no config options (the weights are fixed)")
        key, equals, _ = override.partition("=")
        if not equals:
            raise AnalysisError(f"{override!r}: an override is KEY=VALUE (e.g. {example})")
        if not key.lstrip("+").startswith(f"{section}."):
            raise AnalysisError(f"{override!r}: only {section}.* options apply here (the weights are fixed)")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override.lstrip("+")]))
        except OmegaConfBaseException as error:
            raise AnalysisError(f"{override!r}: {first_line(error)}") from None
    return cfg


def select_steps(saved: list[int], spec: str = "all", every: int = 1) -> list[int]:
    """The saved steps a ``--steps`` spec names: ``all``, ``A:B`` (A to B, both included), or a list
    ``100,200,300`` (each must be saved); then every ``every``-th of them, and always the last, so a
    thinned trajectory still ends where the run ended."""
    if every < 1:
        raise AnalysisError(f"--every {every}: must be >= 1")
    spec = spec.strip()
    if spec == "all":
        chosen = list(saved)
    elif re.fullmatch(r"\d*:\d*", spec):
        low, high = (int(x) if x else None for x in spec.split(":"))
        chosen = [s for s in saved if (low is None or s >= low) and (high is None or s <= high)]
        if not chosen:
            raise AnalysisError(f"--steps {spec}: no saved step in that range (saved: {describe_steps(saved)})")
    elif re.fullmatch(r"\d+(,\d+)*", spec):
        chosen = sorted({int(x) for x in spec.split(",")})
        missing = [s for s in chosen if s not in saved]
        if missing:
            raise AnalysisError(f"--steps: step {missing[0]} was not saved (saved: {describe_steps(saved)})")
    else:
        raise AnalysisError(f"--steps {spec!r}: give all, A:B or a list 100,200,300")
    thinned = chosen[::every]
    return thinned if thinned[-1] == chosen[-1] else [*thinned, chosen[-1]]


def checked_steps(trajectory: Trajectory, spec: str, every: int, at_least: int = 1) -> list[int]:
    """:func:`select_steps` over the run's saved steps, each file checked readable; at least ``at_least``."""
    steps = select_steps(trajectory.steps, spec, every)
    if len(steps) < at_least:
        raise AnalysisError(f"{len(steps)} steps selected ({describe_steps(steps)}): at least {at_least} are needed")
    for step in steps:
        trajectory.check(step)
    return steps


def new_request(
    run_dir: Path,
    cfg: DictConfig,
    overrides: list[str],
    steps: list[int],
    name: str,
    options: dict | None = None,
    device: str = "cpu",
) -> Request:
    """The request, once its name is a plain directory name, its device one this machine has, and
    W&B's mode one it can run in."""
    if not re.fullmatch(r"[A-Za-z0-9._=+,-]+", name) or name in (".", ".."):
        raise AnalysisError(f"--name {name!r}: use letters, digits and . _ = + , -")
    if cfg.logger.wandb.enabled and (problem := wandb_environment_problem()):
        raise AnalysisError(problem)
    if (problem := device_problem(device)) is not None:
        raise AnalysisError(problem)
    return Request(Path(run_dir), cfg, tuple(overrides), steps, name, dict(options or {}), device)


def device_problem(device: str) -> str | None:
    """Why ``--device DEVICE`` cannot run here, or None."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        return f"--device {device!r}: not a torch device (cpu, cuda, cuda:1, mps)"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: no CUDA device is visible to torch"
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"--device {device}: Apple's MPS is not available here"
    if kind not in ("cpu", "cuda", "mps"):
        return f"--device {device}: analyses run on cpu, cuda or mps"
    return None


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@dataclass(frozen=True)
class SavedInterventions:
    """A finished run's training-time interventions, to measure its saved weights as they trained:
    its config's plan with the heads its ``intervention.json`` recorded (a chosen head as chosen)."""

    plan: list[Intervention]
    heads: list[list[tuple[int, int]]]
    description: str = "none"

    @classmethod
    def of(cls, trajectory: Trajectory) -> SavedInterventions:
        plan = plan_of(trajectory.config.get("intervention"))
        try:
            record = json.loads((trajectory.run_dir / INTERVENTION_RECORD).read_text())
        except (OSError, ValueError):
            record = {}
        entries = record.get("interventions", [])
        heads = [
            [named_heads(name, trajectory.shape)[0] for name in (entries[n]["heads"] if n < len(entries) else [])]
            for n in range(len(plan))
        ]
        return cls(plan, heads, record.get("description", "none"))

    def changes_at(self, step: int) -> dict[int, list[HeadChange]]:
        """The forward-pass changes that were active at ``step`` (freezes and grafts act on weights:
        the saved weights already hold them)."""
        by_layer: dict[int, list[HeadChange]] = {}
        for intervention, heads in zip(self.plan, self.heads):
            if intervention.active(step):
                for layer, changes in intervention.changes(heads).items():
                    by_layer.setdefault(layer, []).extend(changes)
        return by_layer
