"""One protocol for every analysis over a finished run's saved weights (``RUN_DIR/trajectory/``).

An analysis is a subclass of :class:`Analysis` that says what it measures at one saved step
(:meth:`Analysis.measure`: a row of numbers and named tensors) and what it concludes from all of
them (:meth:`Analysis.conclude`: a result, tables, figures, W&B summary values and the sweep report's
columns). Everything else is written once, here:

- the command line ``python -m analysis.KIND RUN_DIR [OVERRIDE ...] [--steps] [--every] [--name]
  [--overwrite] [--device]`` (plus the analysis's own flags), over a run directory or every job of a sweep
  directory, every job's request checked before any is measured (one line, exit 2);
- the step loop: a line a step with the time spent and left, Ctrl-C kept;
- the measurement cache (:class:`records.measurements.MeasuredSteps`): a stopped analysis continues
  where it stopped, a finished one is read again under other reading settings without measuring;
- the outputs in ``RUN_DIR/analysis/NAME/``, names from :mod:`records.layout`: the rows
  (``steps.csv`` or the analysis's table), its tables and figures, a W&B run grouped with the training
  run through the same logger and step axis as training (``KIND/...`` at each step, ``images/...``),
  and, written last so that its presence means the analysis is whole, ``analysis.json`` (the
  request, the result, the columns);
- on a sweep: finished jobs kept, then the sweep report with the analysis's columns
  (:mod:`reports.sweep_report` reads them from each job's ``analysis.json``).

An analysis that writes a run's own layout (:mod:`analysis.rescore`: the tracker logs each step)
sets ``run_like``: it gets the CSV and W&B loggers before its first step, and is measured in one go
(the tracker's files are its measurements; no cache).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from omegaconf import OmegaConf

from analysis.saved_run import AnalysisError, Request, SavedInterventions, checked_steps, new_request, run_config
from records.layout import (
    ANALYSIS_DIR,
    ANALYSIS_RECORD,
    INDEX_NAME,
    STEPS_TABLE,
    TRAJECTORY_DIR,
    job_dirs,
    measurements_dir,
)
from records.measurements import MeasuredSteps
from records.trajectory import Trajectory, TrajectoryError, describe_steps


@dataclass
class Conclusion:
    """What an analysis concludes from all its steps.

    ``result``: its findings, kept in ``analysis.json`` (JSON-serialisable); ``tables``: layout file
    name -> rows; ``figures``: layout file name -> a matplotlib figure (saved, logged to W&B as
    ``images/STEM``, closed); ``curves``: step -> more values to log at that step besides its row;
    ``summary``: the W&B run's summary; ``columns``: this job's values in the sweep report's table
    (numbers get a mean ± sd over seeds); ``incomplete``: written, but something failed (exit 1)."""

    result: dict
    tables: dict[str, list[dict]] = field(default_factory=dict)
    figures: dict[str, object] = field(default_factory=dict)
    curves: dict[int, dict[str, float]] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    columns: dict[str, float | str] = field(default_factory=dict)
    incomplete: bool = False


class Analysis:
    """An analysis of a run's saved weights: subclass it, set the class attributes, implement
    :meth:`measure` and :meth:`conclude`, and end its module with ``sys.exit(main(TheAnalysis))``.

    ``kind``: its name (the default ``--name``, the W&B key prefix ``KIND/``); ``section``: the
    config section its overrides may set (``stages``; None: none); ``example``: one such override,
    for error messages; ``table``: where its rows go; ``min_steps``: the fewest steps it can read;
    ``columns_title``: the heading of its columns in the sweep report; ``request_errors``: exception
    types that mean a request cannot run (one line, exit 2). One instance is made per request."""

    kind: ClassVar[str]
    section: ClassVar[str | None] = None
    example: ClassVar[str] = ""
    table: ClassVar[str] = STEPS_TABLE
    min_steps: ClassVar[int] = 1
    run_like: ClassVar[bool] = False
    columns_title: ClassVar[str] = ""
    request_errors: ClassVar[tuple[type[Exception], ...]] = ()

    # --- the request: the class's part, before any instance exists ---

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        """Its own command-line flags (their values reach :attr:`Request.options`)."""

    @classmethod
    def check(cls, cfg, options: dict) -> list[str]:
        """What is wrong with a request's config and options (nothing: []), before any work; may
        settle a default in ``cfg``."""
        return []

    @classmethod
    def default_steps(cls, trajectory: Trajectory) -> str:
        """The ``--steps`` spec used when none is given."""
        return "all"

    @classmethod
    def default_name(cls, overrides: list[str], spec: str, every: int) -> str:
        return cls.kind

    # --- one request ---

    def __init__(self, request: Request) -> None:
        self.request = request
        self.cfg = request.cfg

    def describe(self) -> str:
        """What it measures at each step, for the plan's line."""
        return self.kind

    def settings(self) -> dict:
        """What a step's measurements depend on: other settings discard the cached steps."""
        return {"overrides": list(self.request.overrides), "options": self.request.options}

    def start(self, loggers: list) -> None:
        """Once, before the first step (``loggers``: a run-like analysis's CSV and W&B loggers, else [])."""

    def measure(self, step: int, model) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """``step``'s row of numbers and named tensors (kept in the cache, handed to :meth:`conclude`)."""
        raise NotImplementedError

    def describe_row(self, row: dict) -> str:
        """What a step's progress line says of its row."""
        return ""

    def conclude(self, rows: list[dict], tensors: list[dict[str, torch.Tensor]]) -> Conclusion:
        """Everything it finds from every step's ``rows`` (``step`` included) and ``tensors``."""
        raise NotImplementedError

    def report(self, conclusion: Conclusion) -> None:
        """Print what it found."""


def argument_parser(analysis: type[Analysis], description: str) -> argparse.ArgumentParser:
    """The command line every analysis takes, and its own flags."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run_dir", type=Path, help="a train.py run directory with trajectory/, or a sweep directory")
    options = f"{analysis.section}.* options, e.g. {analysis.example}" if analysis.section else "none"
    parser.add_argument("overrides", nargs="*", help=f"config options: {options}")
    parser.add_argument("--steps", default=None, help="which saved steps: all (default), A:B, or 100,200,300")
    parser.add_argument("--every", type=int, default=1, help="every k-th of the selected steps (and the last)")
    parser.add_argument("--name", default=None, help=f"the analysis's directory name (default: {analysis.kind})")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace analysis/NAME if it exists (that analysis only)"
    )
    parser.add_argument("--device", default="cpu", help="where the weights are measured: cpu (default), cuda, mps")
    analysis.add_options(parser)
    return parser


COMMON_ARGUMENTS = ("run_dir", "overrides", "steps", "every", "name", "overwrite", "device")


def plan(analysis: type[Analysis], run_dir: Path, args: argparse.Namespace) -> Request:
    """One job's request, every part checked (the trajectory and each file it will read, the
    overrides, the options, the name) before anything is written or measured."""
    trajectory = Trajectory(run_dir)
    cfg = run_config(trajectory, list(args.overrides), analysis.section, analysis.example)
    options = {k: v for k, v in vars(args).items() if k not in COMMON_ARGUMENTS}
    problems = analysis.check(cfg, options)
    if problems:
        raise AnalysisError("; ".join(problems))
    spec = args.steps or analysis.default_steps(trajectory)
    steps = checked_steps(trajectory, spec, args.every, at_least=analysis.min_steps)
    name = args.name or analysis.default_name(list(args.overrides), spec, args.every)
    return new_request(run_dir, cfg, list(args.overrides), steps, name, options, args.device)


def sweep_jobs(path: Path) -> list[Path]:
    """The job directories of a sweep directory that kept a trajectory (empty for a run directory)."""
    if (path / TRAJECTORY_DIR).is_dir():
        return []
    return [job for job in job_dirs([path]) if (job / TRAJECTORY_DIR / INDEX_NAME).is_file()]


def finished(request: Request) -> dict | None:
    """The record of ``request``'s analysis if it was written whole before with the same
    overrides, options and steps, else None."""
    try:
        record = json.loads((request.out_dir / ANALYSIS_RECORD).read_text())
    except (OSError, ValueError):
        return None
    same = (record.get("overrides"), record.get("options"), record.get("steps")) == (
        list(request.overrides),
        request.options,
        request.steps,
    )
    return record if same else None


def main(analysis: type[Analysis], argv: list[str] | None = None, description: str = "") -> int:
    """The command: plan every job (the run directory, or each job of a sweep directory) before any
    is measured, so that a bad request is one line (exit 2) with nothing written; then run each, and
    for a sweep print the sweep report with the analysis's columns. In a sweep, a job whose analysis
    was finished by the same request is kept, so the same command finishes an interrupted sweep;
    ``--overwrite`` measures it again. Exit status 1 when any analysis is incomplete, else 0."""
    args = argument_parser(analysis, description).parse_intermixed_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir}: no such run or sweep directory", file=sys.stderr)
        return 2
    jobs = sweep_jobs(args.run_dir)
    requests, kept = [], []
    try:
        for job in jobs or [args.run_dir]:
            request = plan(analysis, job, args)
            if not request.out_dir.exists() or args.overwrite:
                requests.append(request)
            elif jobs and (record := finished(request)) is not None:
                kept.append((request, record))
            else:
                raise AnalysisError(
                    f"{request.out_dir} exists: choose another --name, or --overwrite to replace that analysis"
                )
    except (TrajectoryError, AnalysisError, *analysis.request_errors) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for request, _ in kept:
        print(f"kept: {request.out_dir} (this request, finished before; --overwrite measures it again)")
    records = [record for _, record in kept] + [run(analysis(request)) for request in requests]
    if jobs:
        from reports.sweep_report import print_sweep_report, sweep_report

        name = (requests or [request for request, _ in kept])[0].name
        print_sweep_report(sweep_report(jobs, args.run_dir / ANALYSIS_DIR / name, analysis=name))
    return 1 if any(record["incomplete"] for record in records) else 0


class CtrlC:
    """Ctrl-C while measuring, noted as well as raised. The handler raises ``KeyboardInterrupt`` as
    Python's own does, and remembers that it came: an interrupt that lands inside a native library
    may come out as another error (safetensors' reader turned one into a ``ValueError`` in CI), and
    is still the stop it was."""

    def __init__(self) -> None:
        self.came = False

    def __call__(self, signum: int, frame) -> None:
        self.came = True
        raise KeyboardInterrupt

    @contextmanager
    def watched(self) -> Iterator[None]:
        """This handler for SIGINT while the block runs, where Python's own is in place (not where
        the signal is ignored, nor off the main thread); the one from before after."""
        if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def run(analysis: Analysis) -> dict:
    """Measure every step of the analysis's request (continuing from its cache), conclude, write
    everything; returns the record (``analysis.json``'s content). Ctrl-C while measuring exits 130
    with the measured steps kept; a failure while writing leaves no half-written analysis."""
    request, kind = analysis.request, analysis.kind
    print(
        f"{kind}: {len(request.steps)} saved steps of {request.run_dir} ({describe_steps(request.steps)});"
        f" {analysis.describe()}; into {request.out_dir}",
        flush=True,
    )
    loggers: list = []
    if analysis.run_like:
        from records.csv_log import ResumableCSVLogger

        replace(request.out_dir)
        loggers = [ResumableCSVLogger(request.out_dir), *wandb_loggers(request)]
        cache = None
    else:
        cache = MeasuredSteps(measurements_dir(request.out_dir), {"kind": kind, **analysis.settings()}, kind)
    ctrl_c = CtrlC()
    try:
        with ctrl_c.watched():
            analysis.start(loggers)
            rows, tensors, seconds = measure_steps(analysis, cache)
    except BaseException as error:
        if not (isinstance(error, KeyboardInterrupt) or ctrl_c.came):
            if cache is None:
                shutil.rmtree(request.out_dir, ignore_errors=True)
            raise
        if cache is None:
            shutil.rmtree(request.out_dir, ignore_errors=True)
            print(f"\n{kind}: stopped; nothing kept (it is measured in one go): run the same command again", flush=True)
        else:
            print(
                f"\n{kind}: stopped; {len(cache.steps)} measured steps kept in {cache.directory}: the same command"
                " continues from there",
                flush=True,
            )
        raise SystemExit(130) from None
    try:
        conclusion = analysis.conclude(rows, tensors)
        record = write(analysis, rows, conclusion, loggers, seconds)
    except BaseException as error:  # half-written: the measurements stay, the same command writes it again
        shutil.rmtree(request.out_dir, ignore_errors=True)
        if isinstance(error, KeyboardInterrupt):
            where = f" from {cache.directory}" if cache is not None else ""
            print(f"\n{kind}: stopped while writing; the same command writes it{where}", flush=True)
            raise SystemExit(130) from None
        raise
    analysis.report(conclusion)
    kept = (
        f" (the measurements stay in {cache.directory}: --overwrite with other reading settings reads them again"
        " without measuring)"
        if cache is not None
        else ""
    )
    print(f"{kind}: {len(request.steps)} steps, {seconds:.1f} s of measuring; wrote {request.out_dir}{kept}")
    return record


def replace(out_dir: Path) -> None:
    """An empty ``out_dir``: an earlier analysis of that name (``--overwrite``) removed, that one only."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)


def measure_steps(analysis: Analysis, cache: MeasuredSteps | None) -> tuple[list[dict], list[dict], float]:
    """Every step's row (its ``step`` first) and tensors, from ``cache`` where an earlier run of the
    same request left them, else measured now (and cached); a line a step with the time spent
    measuring and, once a step has been measured, about how long the rest will take. Returns
    ``(rows, tensors, seconds spent measuring now)``."""
    request, kind = analysis.request, analysis.kind
    trajectory, steps = Trajectory(request.run_dir), request.steps
    cached = set(cache.steps) if cache is not None else set()
    if done := len(cached & set(steps)):
        print(
            f"{kind}: continuing: {done} of the {len(steps)} steps are measured already, with these settings"
            f" ({cache.directory})",
            flush=True,
        )
    interventions = SavedInterventions.of(trajectory)
    if interventions.plan:
        print(
            f"{kind}: measuring the model as it trained, with its interventions on where they were: {interventions.description}"
        )
    rows, tensors, spent, fresh = [], [], 0.0, 0
    for i, step in enumerate(steps):
        kept = cache.get(step) if cache is not None else None
        if kept is None:
            started = time.perf_counter()
            model = trajectory.model(step, request.torch_device)
            model.set_changes(interventions.changes_at(step))
            row, step_tensors = analysis.measure(step, model)
            row = {"step": step, **row}
            if cache is not None:
                cache.put(step, row, step_tensors)
            spent, fresh = spent + time.perf_counter() - started, fresh + 1
        else:
            row, step_tensors = kept
        rows.append(row)
        tensors.append(step_tensors)
        to_measure = sum(1 for later in steps[i + 1 :] if later not in cached)
        left = f", about {spent / fresh * to_measure:.0f} s left" if fresh and to_measure else ""
        said = analysis.describe_row(row)
        print(
            f"{kind}: step {step} ({i + 1}/{len(steps)}){': ' + said if said else ''}{' (kept)' if kept else ''};"
            f" {spent:.0f} s of measuring{left}",
            flush=True,
        )
    return rows, tensors, spent


def write(analysis: Analysis, rows: list[dict], conclusion: Conclusion, loggers: list, seconds: float) -> dict:
    """The rows, tables and figures, the W&B run, and last (its presence means the analysis is
    whole) the record; returns the record."""
    from records.tables import write_rows
    from reports.plots import plt

    request, out = analysis.request, analysis.request.out_dir
    if not analysis.run_like:
        replace(out)  # --overwrite: this analysis only, and only once the new one is measured
        loggers = wandb_loggers(request)
        write_rows(out / analysis.table, rows)
    for name, table in conclusion.tables.items():
        write_rows(out / name, table)
    for name, figure in conclusion.figures.items():
        figure.savefig(out / name, dpi=110)
        plt.close(figure)
    log_to_wandb(analysis, rows, conclusion, loggers)
    record = {
        "analysis": analysis.kind,
        "run_dir": str(request.run_dir),
        "name": request.name,
        "overrides": list(request.overrides),
        "options": request.options,
        "steps": request.steps,
        "seconds": seconds,
        "run_like": analysis.run_like,
        "incomplete": conclusion.incomplete,
        "columns_title": analysis.columns_title,
        "columns": conclusion.columns,
        "result": conclusion.result,
    }
    written = out / f"{ANALYSIS_RECORD}.tmp"
    written.write_text(json.dumps(record, indent=1))
    written.replace(out / ANALYSIS_RECORD)
    return record


def wandb_loggers(request: Request) -> list:
    """A W&B logger for the analysis, grouped with the training run, or none when the run had W&B off."""
    w = request.cfg.logger.wandb
    if not w.enabled:
        return []
    from records.wandb_log import analysis_logger

    run = Trajectory(request.run_dir).run
    trained_as = run.get("wandb_name") or request.run_dir.name
    config = OmegaConf.to_container(request.cfg, resolve=True, enum_to_str=True)
    config["analysis"] = {
        "run_dir": str(request.run_dir),
        "overrides": list(request.overrides),
        "options": request.options,
        "name": request.name,
        "wandb_id": run.get("wandb_id"),
    }
    return [
        analysis_logger(
            request.cfg,
            request.out_dir,
            group=run.get("wandb_group") or trained_as,
            job_type="analysis",
            name=f"{trained_as} / {request.name}",
            tags=[ANALYSIS_DIR, *list(request.overrides)[:8]],
            config=config,
        )
    ]


def log_to_wandb(analysis: Analysis, rows: list[dict], conclusion: Conclusion, loggers: list) -> None:
    """Each step's row and curves (``KIND/KEY`` on training's step axis; a run-like analysis's
    tracker logged its own), the figures (``images/STEM``) and the summary; then the loggers end."""
    from records.wandb_log import SectionedWandbLogger

    last = rows[-1]["step"]
    for logger in loggers:
        if isinstance(logger, SectionedWandbLogger):
            for row in [] if analysis.run_like else rows:
                values = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
                values.update(conclusion.curves.get(row["step"], {}))
                logger.log_metrics({f"{analysis.kind}/{k}": v for k, v in values.items()}, step=row["step"])
            for name in conclusion.figures:
                image = analysis.request.out_dir / name
                logger.log_image(key=f"images/{Path(name).stem}", images=[str(image)], step=last)
            if conclusion.summary:
                logger.log_summary(conclusion.summary)
        logger.finalize("success")
        if isinstance(logger, SectionedWandbLogger):
            logger.finish()
