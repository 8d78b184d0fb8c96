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

import json
import re
import shutil
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from analysis.saved_run import (
    AnalysisError,
    Request,
    argument_parser,
    checked_steps,
    new_request,
    run_config,
    run_each_job,
    wandb_loggers,
)
from conf.validate import tracker_problems
from records.layout import RESCORE_RECORD
from records.trajectory import Trajectory, describe_steps

DEFAULT_NAME = "rescore"


def tracker_config(trajectory: Trajectory, overrides: list[str]) -> DictConfig:
    """The run's resolved config on the typed schema, with ``overrides`` (``tracker.*`` only) applied
    and checked as ``train.py`` checks them."""
    cfg = run_config(trajectory, overrides, "tracker", "tracker.ablation.kind=resample")
    cfg.tracker.enabled = True
    problems = tracker_problems(cfg)
    if problems:
        raise AnalysisError("; ".join(problems))
    return cfg


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
) -> Request:
    """Check everything before anything is written: the trajectory, every selected file, the
    overrides, the output directory's name."""
    trajectory = Trajectory(run_dir)
    cfg = tracker_config(trajectory, overrides)
    steps = checked_steps(trajectory, spec, every)
    return new_request(run_dir, cfg, overrides, steps, name or analysis_name(overrides, spec, every))


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
    (out / RESCORE_RECORD).write_text(
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


def finish_wandb() -> None:
    import wandb

    if wandb.run is not None:
        wandb.finish()


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(
        __doc__.split("\n\n")[0],
        'tracker options: "tracker.measures=[subspace]" tracker.ablation.kind=resample ...',
        "from the overrides",
        epilog="Overrides are the tracker's options, as train.py takes them.",
    )
    return run_each_job(parser.parse_intermixed_args(argv), plan, rescore, report_as="analysis")


if __name__ == "__main__":
    sys.exit(main())
