"""Re-score a finished run from its saved weights, with tracker options it did not train with.

    python -m analysis.rescore RUN_DIR "tracker.measures=[subspace,token_space]"
    python -m analysis.rescore RUN_DIR tracker.ablation.kind=resample --steps 300:600
    python -m analysis.rescore RUN_DIR tracker.probe_batch_size=64 --every 2 --name probe64
    python -m analysis.rescore multirun/2026-11-23/10-00-00 "tracker.measures=[subspace]"   # every job, then the sweep report

Every selected saved step (``RUN_DIR/trajectory/``) is measured by the tracker's own snapshot code
(:meth:`callbacks.tracker.CompositionTracker.measure`), with every part the tracker options turn on
(a part's ``every_n_steps`` > 0) at every step; heatmaps keep their period. The outputs are those of
a run, under ``RUN_DIR/analysis/NAME/``: ``csv/metrics.csv`` (the same keys), ``tensors/``, the
figures, ``summary.json``, the validity table, and a W&B run (``job_type=analysis``) in the training
run's group (its sweep's, or one named after the run); W&B is offline unless the run's config or
``$WANDB_MODE`` says otherwise. Nothing outside ``analysis/NAME/`` is written, and an existing
analysis is never replaced unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from conf.schema import Config
from conf.validate import tracker_problems
from records.layout import ANALYSIS_DIR, TRAJECTORY_DIR
from records.trajectory import Trajectory, TrajectoryError, describe_steps

DEFAULT_NAME = "rescore"


class RescoreError(ValueError):
    """A request that cannot run: the message says what is wrong, in one line."""


@dataclass(frozen=True)
class Request:
    """What to re-score: the tracker config (the run's, with the overrides), which steps, where."""

    run_dir: Path
    cfg: DictConfig
    overrides: tuple[str, ...]
    steps: list[int]
    name: str

    @property
    def out_dir(self) -> Path:
        return self.run_dir / ANALYSIS_DIR / self.name


def tracker_config(trajectory: Trajectory, overrides: list[str]) -> DictConfig:
    """The run's resolved config on the typed schema, with ``overrides`` (``tracker.*`` only) applied
    and checked as ``train.py`` checks them."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), trajectory.config)
    except OmegaConfBaseException as error:
        raise RescoreError(f"the run's config does not fit this version's schema ({_first_line(error)})") from None
    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals:
            raise RescoreError(f"{override!r}: an override is KEY=VALUE (e.g. tracker.ablation.kind=resample)")
        if not key.lstrip("+").startswith("tracker."):
            raise RescoreError(
                f"{override!r}: only tracker.* options can change after training (the weights are fixed)"
            )
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override.lstrip("+")]))
        except OmegaConfBaseException as error:
            raise RescoreError(f"{override!r}: {_first_line(error)}") from None
    cfg.tracker.enabled = True
    problems = tracker_problems(cfg)
    if problems:
        raise RescoreError("; ".join(problems))
    return cfg


def select_steps(saved: list[int], spec: str = "all", every: int = 1) -> list[int]:
    """The saved steps a ``--steps`` spec names: ``all``, ``A:B`` (A to B, both included), or a list
    ``100,200,300`` (each must be saved); then every ``every``-th of them, and always the last, so a
    thinned trajectory still ends where the run ended."""
    if every < 1:
        raise RescoreError(f"--every {every}: must be >= 1")
    spec = spec.strip()
    if spec == "all":
        chosen = list(saved)
    elif re.fullmatch(r"\d*:\d*", spec):
        low, high = (int(x) if x else None for x in spec.split(":"))
        chosen = [s for s in saved if (low is None or s >= low) and (high is None or s <= high)]
        if not chosen:
            raise RescoreError(f"--steps {spec}: no saved step in that range (saved: {describe_steps(saved)})")
    elif re.fullmatch(r"\d+(,\d+)*", spec):
        chosen = sorted({int(x) for x in spec.split(",")})
        missing = [s for s in chosen if s not in saved]
        if missing:
            raise RescoreError(f"--steps: step {missing[0]} was not saved (saved: {describe_steps(saved)})")
    else:
        raise RescoreError(f"--steps {spec!r}: give all, A:B or a list 100,200,300")
    thinned = chosen[::every]
    return thinned if thinned[-1] == chosen[-1] else [*thinned, chosen[-1]]


def analysis_name(overrides: list[str], spec: str, every: int) -> str:
    """A directory name from the overrides and the step selection: ``measures=subspace+token_space``."""
    parts = [
        o.lstrip("+").removeprefix("tracker.").replace("[", "").replace("]", "").replace(",", "+") for o in overrides
    ]
    if spec != "all":
        parts.append(f"steps={spec.replace(':', '-').replace(',', '+')}")
    if every > 1:
        parts.append(f"every={every}")
    name = re.sub(r"[^A-Za-z0-9._=+-]", "_", ",".join(parts))[:120]
    return name or DEFAULT_NAME


def plan(
    run_dir: Path,
    overrides: list[str],
    spec: str = "all",
    every: int = 1,
    name: str | None = None,
    overwrite: bool = False,
) -> Request:
    """Check everything before anything is written: the trajectory, every selected file, the
    overrides, the output directory."""
    trajectory = Trajectory(run_dir)
    cfg = tracker_config(trajectory, overrides)
    steps = select_steps(trajectory.steps, spec, every)
    for step in steps:
        trajectory.check(step)
    name = name or analysis_name(overrides, spec, every)
    if not re.fullmatch(r"[A-Za-z0-9._=+,-]+", name) or name in (".", ".."):
        raise RescoreError(f"--name {name!r}: use letters, digits and . _ = + , -")
    request = Request(Path(run_dir), cfg, tuple(overrides), steps, name)
    if request.out_dir.exists() and not overwrite:
        raise RescoreError(f"{request.out_dir} exists: choose another --name, or --overwrite to replace that analysis")
    return request


def rescore(request: Request) -> dict:
    """Measure every step of ``request`` and write the run-like outputs; returns the summary."""
    from tqdm import tqdm  # heavy imports only once the request is known to be good

    from conf.build import build_tracker
    from records.csv_log import ResumableCSVLogger
    from reports.run_report import publish_report

    trajectory = Trajectory(request.run_dir)
    out = request.out_dir
    if out.exists():
        shutil.rmtree(out)  # --overwrite: this analysis only
    out.mkdir(parents=True)
    (out / "rescore.json").write_text(
        json.dumps(
            {
                "run_dir": str(request.run_dir),
                "overrides": list(request.overrides),
                "steps": request.steps,
                "tracker": OmegaConf.to_container(request.cfg.tracker, resolve=True, enum_to_str=True),
            },
            indent=1,
        )
    )
    tracker = build_tracker(request.cfg, out)
    tracker.schedule = tracker.schedule.at_every_step()
    tracker.cost_report = False
    loggers = [ResumableCSVLogger(out), *wandb_loggers(request, trajectory)]
    tracker.open(trajectory.model(request.steps[0]), request.steps[0])
    parts = describe_parts(tracker)
    print(
        f"rescore: {len(request.steps)} saved steps of {request.run_dir} ({describe_steps(request.steps)}), {parts}; into {out}"
    )
    started = time.perf_counter()
    bar = tqdm(request.steps, unit="step", file=sys.stderr, disable=not sys.stderr.isatty(), desc="rescore")
    for i, step in enumerate(bar):
        tracker.snapshot(loggers, trajectory.model(step), step, last=step == request.steps[-1])
        n, elapsed = len(request.steps), time.perf_counter() - started
        if i == 0:
            first = elapsed
            print(f"rescore: the first step took {first:.2f} s, one-time set-up included (W&B, caches)", flush=True)
        if i == 1:
            print(
                f"rescore: a step takes {elapsed - first:.2f} s: about {first + (elapsed - first) * (n - 1):.0f} s for the {n} steps",
                flush=True,
            )
        elif bar.disable and ((i + 1) % max(1, n // 10) == 0 or i + 1 == n):  # no bar (a log file): a line every tenth
            print(f"rescore: {i + 1}/{n} steps ({elapsed:.1f} s)", flush=True)
    tracker.close()
    seconds = time.perf_counter() - started
    report = publish_report(out, loggers, request.steps[-1], request.cfg.tracker.smoothing_window)
    for logger in loggers:
        logger.finalize("success")
    finish_wandb()
    print(f"rescore: {len(request.steps)} steps in {seconds:.1f} s; wrote {out}")
    return report.summary if report is not None else {}


def describe_parts(tracker) -> str:
    s = tracker.schedule
    parts = [f"{len(tracker.measures)} measure{'s' * (len(tracker.measures) != 1)} ({', '.join(tracker.measures)})"]
    if s.ablation:
        parts.append(f"ablation ({tracker.ablation_method}, {tracker.ablation_kind})")
    parts += [name for name, every in (("copying", s.copying), ("matching", s.matching)) if every]
    return ", ".join(parts) + f", probe of {tracker.probe.tokens.shape[0]} sequences"


def wandb_loggers(request: Request, trajectory: Trajectory) -> list:
    """A W&B logger for the analysis, grouped with the training run, or none when the run had W&B off."""
    w = request.cfg.logger.wandb
    if not w.enabled:
        return []
    from conf.build import wandb_mode
    from records.wandb_log import SectionedWandbLogger
    from records.wandb_reach import effective_mode

    run = trajectory.run
    trained_as = run.get("wandb_name") or request.run_dir.name
    mode = effective_mode(wandb_mode(request.cfg), w.connect_timeout_s, request.out_dir)
    config = OmegaConf.to_container(request.cfg, resolve=True, enum_to_str=True)
    config["rescore"] = {
        "run_dir": str(request.run_dir),
        "overrides": list(request.overrides),
        "name": request.name,
        "wandb_id": run.get("wandb_id"),
    }
    return [
        SectionedWandbLogger(
            project=w.project,
            entity=w.entity,
            group=run.get("wandb_group") or trained_as,
            job_type="analysis",
            name=f"{trained_as} / {request.name}",
            tags=[ANALYSIS_DIR, *list(request.overrides)[:8]],
            save_dir=str(request.out_dir),
            mode=mode,
            config=config,
        )
    ]


def finish_wandb() -> None:
    import wandb

    if wandb.run is not None:
        wandb.finish()


def sweep_jobs(path: Path) -> list[Path]:
    """The job directories of a sweep directory that kept a trajectory (empty for a run directory)."""
    if (path / TRAJECTORY_DIR).is_dir():
        return []
    return sorted(
        (p.parent.parent for p in path.glob("*/trajectory/index.json")),
        key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Overrides are the tracker's options, as train.py takes them."
    )
    parser.add_argument("run_dir", type=Path, help="a train.py run directory with trajectory/, or a sweep directory")
    parser.add_argument(
        "overrides", nargs="*", help='tracker options: "tracker.measures=[subspace]" tracker.ablation.kind=resample ...'
    )
    parser.add_argument("--steps", default="all", help="which saved steps: all (default), A:B, or 100,200,300")
    parser.add_argument("--every", type=int, default=1, help="every k-th of the selected steps")
    parser.add_argument("--name", default=None, help="the analysis's directory name (default: from the overrides)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace analysis/NAME if it exists (that analysis only)"
    )
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir}: no such run or sweep directory", file=sys.stderr)
        return 2
    jobs = sweep_jobs(args.run_dir)
    try:  # every job is checked before any is written
        requests = [
            plan(job, args.overrides, args.steps, args.every, args.name, args.overwrite)
            for job in (jobs or [args.run_dir])
        ]
    except (TrajectoryError, RescoreError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for request in requests:
        rescore(request)
    if jobs:
        from reports.sweep_report import print_sweep_report, sweep_report

        out = args.run_dir / ANALYSIS_DIR / requests[0].name
        print_sweep_report(sweep_report(jobs, out, analysis=requests[0].name))
    return 0


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


if __name__ == "__main__":
    sys.exit(main())
