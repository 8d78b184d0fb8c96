"""What every analysis of a finished run's saved weights shares (:mod:`analysis.rescore`,
:mod:`analysis.stages`): the run's config with one section's overrides, the saved steps to read,
the output directory ``RUN_DIR/analysis/NAME/``, the W&B run grouped with the training run, and the
command line over a run directory or every job of a sweep directory, each checked before any is
written.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from conf.schema import Config
from conf.validate import wandb_environment_problem
from records.layout import ANALYSIS_DIR, INDEX_NAME, TRAJECTORY_DIR
from records.trajectory import Trajectory, TrajectoryError, describe_steps

RETIRED_KEYS = ("stages.window", "stages.min_turn")
"""Settings a run trained by an earlier version may carry that this version no longer has (the
turning-point finder's smoothing and threshold): dropped when the run is analysed."""


class AnalysisError(ValueError):
    """A request that cannot run: the message says what is wrong, in one line."""


@dataclass(frozen=True)
class Request:
    """What to analyse: the run's config (with the overrides), which saved steps, where."""

    run_dir: Path
    cfg: DictConfig
    overrides: tuple[str, ...]
    steps: list[int]
    name: str

    @property
    def out_dir(self) -> Path:
        return self.run_dir / ANALYSIS_DIR / self.name


def run_config(trajectory: Trajectory, overrides: list[str], section: str, example: str) -> DictConfig:
    """The run's resolved config on the typed schema, with ``overrides`` applied; only ``SECTION.*``
    keys may change (the weights are fixed). ``example`` is a valid override, for the error message."""
    saved = copy.deepcopy(trajectory.config)
    for key in RETIRED_KEYS:  # written by earlier versions, read by none: not a reason to refuse the run
        group, _, name = key.partition(".")
        saved.get(group, {}).pop(name, None)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), saved)
    except OmegaConfBaseException as error:
        raise AnalysisError(f"the run's config does not fit this version's schema ({first_line(error)})") from None
    for override in overrides:
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


def new_request(run_dir: Path, cfg: DictConfig, overrides: list[str], steps: list[int], name: str) -> Request:
    """The request, once its name is a plain directory name."""
    if not re.fullmatch(r"[A-Za-z0-9._=+,-]+", name) or name in (".", ".."):
        raise AnalysisError(f"--name {name!r}: use letters, digits and . _ = + , -")
    if cfg.logger.wandb.enabled and (problem := wandb_environment_problem()):
        raise AnalysisError(problem)
    return Request(Path(run_dir), cfg, tuple(overrides), steps, name)


def wandb_loggers(request: Request, trajectory: Trajectory) -> list:
    """A W&B logger for the analysis, grouped with the training run, or none when the run had W&B off."""
    w = request.cfg.logger.wandb
    if not w.enabled:
        return []
    from conf.build import wandb_logger

    run = trajectory.run
    trained_as = run.get("wandb_name") or request.run_dir.name
    config = OmegaConf.to_container(request.cfg, resolve=True, enum_to_str=True)
    config["analysis"] = {
        "run_dir": str(request.run_dir),
        "overrides": list(request.overrides),
        "name": request.name,
        "wandb_id": run.get("wandb_id"),
    }
    return [
        wandb_logger(
            request.cfg,
            request.out_dir,
            group=run.get("wandb_group") or trained_as,
            job_type="analysis",
            name=f"{trained_as} / {request.name}",
            tags=[ANALYSIS_DIR, *list(request.overrides)[:8]],
            config=config,
        )
    ]


def sweep_jobs(path: Path) -> list[Path]:
    """The job directories of a sweep directory that kept a trajectory (empty for a run directory)."""
    from reports.sweep_report import job_dirs  # how the sweep report finds a sweep's jobs

    if (path / TRAJECTORY_DIR).is_dir():
        return []
    return [job for job in job_dirs([path]) if (job / TRAJECTORY_DIR / INDEX_NAME).is_file()]


def argument_parser(description: str, overrides_help: str, name_default: str, epilog: str | None = None):
    """The command line every analysis takes: ``RUN_DIR [OVERRIDE ...] [--steps] [--every] [--name] [--overwrite]``."""
    parser = argparse.ArgumentParser(description=description, epilog=epilog)
    parser.add_argument("run_dir", type=Path, help="a train.py run directory with trajectory/, or a sweep directory")
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    parser.add_argument("--steps", default="all", help="which saved steps: all (default), A:B, or 100,200,300")
    parser.add_argument("--every", type=int, default=1, help="every k-th of the selected steps (and the last)")
    parser.add_argument("--name", default=None, help=f"the analysis's directory name (default: {name_default})")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace analysis/NAME if it exists (that analysis only)"
    )
    return parser


def run_each_job(
    args: argparse.Namespace,
    plan: Callable[..., Request],
    analyse: Callable[[Request], object],
    report_as: str,
    errors: tuple[type[Exception], ...] = (),
    incomplete: Callable[[object], bool] = lambda result: False,
    finished: Callable[[Request], object | None] | None = None,
) -> int:
    """``plan`` every job (the run directory, or each job of a sweep directory) before any is
    analysed, so that a bad request is one line (exit 2) with nothing written; then ``analyse``
    each, and for a sweep print its report read from the analyses (``sweep_report(..., {report_as}=NAME)``).
    In a sweep, a job whose analysis is already ``finished`` (the same request, written whole: its
    result) is kept, so the same command again finishes an interrupted sweep; ``--overwrite``
    measures it again.
    Exit status 1 when any analysis is ``incomplete`` (written, but with parts that failed), else 0."""
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir}: no such run or sweep directory", file=sys.stderr)
        return 2
    jobs = sweep_jobs(args.run_dir)
    requests, kept = [], []
    try:
        for job in jobs or [args.run_dir]:
            request = plan(job, args.overrides, args.steps, args.every, args.name)
            if not request.out_dir.exists() or args.overwrite:
                requests.append(request)
            elif jobs and finished is not None and (result := finished(request)) is not None:
                kept.append((request, result))
            else:
                raise AnalysisError(
                    f"{request.out_dir} exists: choose another --name, or --overwrite to replace that analysis"
                )
    except (TrajectoryError, AnalysisError, *errors) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for request, _ in kept:
        print(f"kept: {request.out_dir} (this request, finished before; --overwrite measures it again)")
    results = [result for _, result in kept] + [analyse(request) for request in requests]
    if jobs:
        from reports.sweep_report import print_sweep_report, sweep_report

        name = (requests or [request for request, _ in kept])[0].name
        print_sweep_report(sweep_report(jobs, args.run_dir / ANALYSIS_DIR / name, **{report_as: name}))
    return 1 if any(incomplete(result) for result in results) else 0


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
