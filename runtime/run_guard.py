"""A Hydra callback that decides, before Hydra creates or writes anything, whether a run may start
and in which directory.

Hydra makes the run directory and writes ``.hydra/`` into it before it calls ``train.py``'s main, so
a check there comes too late: a bad config would leave an empty run directory behind, and a run
pointed at a finished run's directory would already have overwritten that run's ``.hydra/``. In
``on_run_start`` this callback

- validates the config (``conf.validate``): a problem is one line on stderr and exit 1, nothing made;
- resumes in place: ``resume=RUN_DIR`` makes ``RUN_DIR`` the run directory (unless ``hydra.run.dir``
  is given), and a requeued SLURM job resumes the run it started; Hydra's files for a resume go to
  ``.hydra/resume-TIME/`` so the run's own ``.hydra/`` stays as it was;
- refuses a run directory that holds another run's results.

Multirun jobs get their directories from the launcher; ``train.py`` validates each job itself.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from conf.validate import ConfigError, validate
from records.layout import holds_a_run, resume_hydra_dir, resumed_run_dir
from runtime.console import release_startup_errors
from runtime.slurm import requeued_slurm_run, requeued_slurm_sweep


def task_config(config: DictConfig) -> DictConfig:
    """The config ``train.py`` receives: Hydra's node removed."""
    return OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])


def why_not_creatable(directory: Path) -> str | None:
    """Why ``directory`` cannot be made, or None once it exists (Hydra would make it next anyway;
    made here, a failure is one line rather than Hydra's traceback)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{error.strerror} ({error.filename})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def unknown_override(config: DictConfig) -> str | None:
    """A sweep's command-line key that its config does not have, as a single run says it (Hydra checks a
    sweep's keys only job by job, after making the sweep's directory); None when every key is known.
    Keys added with ``+``, removed with ``~``, config groups (``data=...``) and the keys under a swept
    group are not checked here (each job's composition checks them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    from conf.validate import did_you_mean

    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    groups = {p.name for p in Path(__file__).resolve().parents[1].joinpath("conf").iterdir() if p.is_dir()}
    swept_groups = {o.key_or_group for o in overrides if o.key_or_group in groups and o.is_sweep_override()}
    for override in overrides:
        key = override.key_or_group
        if override.type != OverrideType.CHANGE or "/" in key or key in groups or key.startswith("hydra."):
            continue
        if key.split(".", 1)[0] in swept_groups:
            continue
        if OmegaConf.select(config, key, default=MISSING_KEY) is MISSING_KEY:
            return f"Could not override '{key}': the config has no such key{did_you_mean(key)}"
    return None


MISSING_KEY = object()


def run_dir_overridden(config: DictConfig) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == "hydra.run.dir" for o in config.hydra.overrides.hydra)


class RunGuard(Callback):
    """See the module docstring: the checks and choices made before Hydra writes the run directory."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        release_startup_errors()  # the command line composed: from here on, stderr is the launcher's
        if (requeued := requeued_slurm_sweep()) is not None:  # an ensemble's SLURM job, requeued
            with read_write(config), open_dict(config):
                config.hydra.sweep.dir = str(requeued)
                # each job's config is composed again from these overrides (Hydra's load_sweep_config)
                kept = [o for o in config.hydra.overrides.hydra if not o.startswith("hydra.sweep.dir=")]
                config.hydra.overrides.hydra = [*kept, f"hydra.sweep.dir={requeued}"]
            print(f"SLURM job requeued: resuming the ensemble in {requeued}", file=sys.stderr)
        if problem := unknown_override(config):
            sys.exit(f"config error: {problem}")
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        if (why := why_not_creatable(sweep_dir)) is not None:
            sys.exit(f"error: cannot make the sweep directory {sweep_dir}: {why}")

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        release_startup_errors()
        with read_write(config), open_dict(config):
            requeued = requeued_slurm_run() if config.resume is None else None
            if requeued is not None:
                config.resume = str(requeued)
                print(f"SLURM job requeued: resuming {requeued}", file=sys.stderr)
            in_place = resumed_run_dir(config.resume)
            if in_place is not None and not run_dir_overridden(config):
                config.hydra.run.dir = str(in_place)
            run_dir = Path(str(config.hydra.run.dir)).resolve()
            if in_place is not None and in_place == run_dir:
                config.hydra.output_subdir = resume_hydra_dir(f"{datetime.now():%Y-%m-%d_%H-%M-%S-%f}")
        try:
            validate(task_config(config))
        except ConfigError as error:
            sys.exit(f"config error: {error}")
        if (why := why_not_creatable(run_dir)) is not None:
            sys.exit(f"error: cannot make the run directory {run_dir}: {why}")
        found = holds_a_run(run_dir) if run_dir.is_dir() else []
        if found and in_place != run_dir:
            sys.exit(
                f"error: {run_dir} already holds a run ({', '.join(found)}): continue it with resume={run_dir},"
                " or choose another hydra.run.dir; nothing was written"
            )
