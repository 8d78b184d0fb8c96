"""A sweep, read as one result: a row per job, the same grouped over seeds, and three figures.

Reads the run directories a sweep wrote (each job's ``.hydra/``, ``status.json``, ``summary.json``,
``csv/metrics.csv`` and ``tensors/``), so it works on any finished or half-finished sweep, and on
any set of run directories given one by one; given no run directory, it reads W&B offline runs
(``offline-run-*`` directories, or any directory holding them: e.g. copied from a cluster):

    python -m reports.sweep_report multirun/2026-11-23/10-00-00
    python -m reports.sweep_report outputs/2026-11-23/10-00-00 outputs/2026-11-23/11-00-00
    python -m reports.sweep_report --out report/ wandb_runs/offline-run-*
    python -m reports.sweep_report multirun/2026-11-23/10-00-00 --analysis stages   # with each job's analysis/stages/

Writes into the sweep directory (the first one given): ``sweep_jobs.csv`` (a row per job),
``sweep_groups.csv`` (per value of the swept parameters: mean and standard deviation over seeds),
``sweep_loss_curves.png`` (every job's repeated-token loss, coloured by the swept parameter) and
``sweep_midpoints.png`` (the phase-change midpoint against each swept parameter, error bars over
seeds) and ``sweep_aligned.png`` (every job's curves against the step relative to its own midpoint);
prints both tables, and with ``--analysis NAME`` each job's columns of that analysis (what its
``analysis.json`` lists: stage boundaries, an LLC calibration's pick, ...) with their mean ± sd over
seeds. At the end of a multirun, ``runtime/sweep_callback.py`` runs it and logs
the tables and figures to a W&B summary run of the sweep's group (a sweep run with ``figures=false``:
the tables alone, which this command completes).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import yaml

from metrics.dynamics.stages import boundary_columns
from metrics.heads.circuit_pair import circuit_pair
from records import wandb_records
from records.keys import flatten
from records.layout import (
    ANALYSIS_DIR,
    ANALYSIS_RECORD,
    CSV_RELATIVE_PATH,
    HYDRA_CONFIG,
    HYDRA_DIR,
    HYDRA_OVERRIDES,
    INDEX_NAME,
    STAGES_RECORD,
    STATUS_FILE,
    SUMMARY_NAME,
    SWEEP_ALIGNED_FIGURE,
    SWEEP_CURVES_FIGURE,
    SWEEP_GROUPS_TABLE,
    SWEEP_INTERVENTIONS_FIGURE,
    SWEEP_JOBS_TABLE,
    SWEEP_MIDPOINTS_FIGURE,
    SWEEP_TRAINING_VALIDITY,
    TENSORS_DIR,
    job_dirs,
)
from records.status import FINISHED, read_status
from records.tables import write_rows
from records.tensor_store import read_tensor_store
from records.wandb_sections import STEP_KEY, tracker_key
from reports import intervention_report
from reports.run_report import read_series

T = TypeVar("T")
SEED_KEYS = ("seed", "data.seed")  # what varies between repeats, not between settings


@dataclass
class Job:
    """One run of a sweep: where, with which overrides, how it ended, and its numbers."""

    run_dir: Path
    overrides: dict[str, str]
    status: str
    error: str = ""  # why it did not finish, from its status.json
    values: dict[str, float | str] = field(default_factory=dict)
    loss_curve: tuple[np.ndarray, np.ndarray] | None = None  # (steps, repeated-token loss)
    induction_curve: tuple[np.ndarray, np.ndarray] | None = None  # (steps, top induction score)
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # intervention_report.CURVES
    config: dict = field(default_factory=dict)  # the run's resolved config (.hydra/config.yaml, or W&B's)


def read_overrides(run_dir: Path) -> dict[str, str]:
    return read_overrides_file(run_dir / HYDRA_DIR / HYDRA_OVERRIDES)


def read_overrides_file(path: Path) -> dict[str, str]:
    listed = yaml.safe_load(path.read_text()) or []
    return dict(o.lstrip("+~").split("=", 1) for o in listed if "=" in o and not o.startswith(("hydra.", "resume")))


def read_part(path: Path, read: Callable[[Path], T], empty: T) -> T:
    """``read(path)``; where the file is damaged (or a store's part is), one line naming it and ``empty``
    in its place: the job's row goes on without it."""
    try:
        return read(path)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, yaml.YAMLError) as error:
        why = str(error).splitlines()[0][:100] if str(error) else type(error).__name__
        print(f"{path}: damaged, left out of its job's row ({why})", file=sys.stderr)
        return empty


def read_job(run_dir: Path, analysis: str | None = None) -> tuple[Job, dict]:
    """Everything the tables and figures need from one run directory; what is missing stays missing.
    ``analysis``: also the columns of the run's analysis ``analysis/NAME/`` (its ``analysis.json``,
    :mod:`analysis.protocol`), whose numbers replace the run's when it re-scored it (``run_like``).
    Returns the job and that analysis's record ({} without one)."""
    record = read_status(run_dir) or {
        "status": "unknown",
        "error": (
            f"its {STATUS_FILE} is damaged"
            if (run_dir / STATUS_FILE).is_file()
            else f"no {STATUS_FILE} (killed outright, or not a train.py run)"
        ),
    }
    config = read_part(run_dir / HYDRA_DIR / HYDRA_CONFIG, lambda p: yaml.safe_load(p.read_text()) or {}, {})
    overrides = read_part(run_dir / HYDRA_DIR / HYDRA_OVERRIDES, read_overrides_file, {})
    job = Job(run_dir, overrides, record["status"], record.get("error") or "", config=config)
    analysed = read_analysis(run_dir / ANALYSIS_DIR / analysis) if analysis else {}
    results = run_dir / ANALYSIS_DIR / analysis if analysed.get("run_like") else run_dir
    summary_path = results / SUMMARY_NAME
    csv_path = results / CSV_RELATIVE_PATH
    fill_values(
        job,
        config.get("seed", "") if isinstance(config, dict) else "",
        read_part(csv_path, read_series, {}) if csv_path.is_file() and csv_path.stat().st_size else {},
        read_part(summary_path, lambda p: dict(json.loads(p.read_text())), {}) if summary_path.is_file() else {},
    )
    job.values["circuit_pair"] = read_part(results / TENSORS_DIR, lambda p: final_circuit_pair(results), "")
    job.values.update(analysed.get("columns", {}))
    return job, analysed


def read_analysis(directory: Path) -> dict:
    """An analysis's record (``analysis.json``); for a stage analysis an earlier version wrote
    (``stages.json``, no record), one with its boundaries as columns; {} when there is neither."""
    try:
        return json.loads((directory / ANALYSIS_RECORD).read_text())
    except (OSError, ValueError):
        pass
    try:
        stages = json.loads((directory / STAGES_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {
        "columns_title": "stage boundaries (an earlier version's stages.json; python -m analysis.stages --overwrite measures them again)",
        "columns": boundary_columns(stages.get("boundaries", [])),
    }


def fill_values(job: Job, seed, series: dict[str, tuple[np.ndarray, np.ndarray]], summary: dict) -> None:
    """The table's numbers from a run's logged series and its end-of-run summary."""
    job.values["seed"] = seed
    for part in ("onset", "midpoint", "end"):
        job.values[f"phase_change_{part}"] = summary.get(f"phase_change/loss_{part}_step", math.nan)
    for part in ("onset", "midpoint"):  # the top induction score's rise (Aoyama et al. time its prefix matching)
        job.values[f"induction_{part}"] = summary.get(f"phase_change/induction_{part}_step", math.nan)
    why = summary.get("phase_change/loss_why") or summary.get("phase_change/left_out")
    if why:  # no phase change, or no end within the run: the run's own sentence
        job.values["phase_change_why"] = why
    job.values["top_induction_score"] = summary.get("final/heads/induction/top", math.nan)
    job.values["intervention"] = summary.get("intervention", "none")
    if "loss/repeated" in series:
        steps, values = series["loss/repeated"]
        job.loss_curve = (steps, values)
        job.values["repeated_loss_start"], job.values["repeated_loss_end"] = float(values[0]), float(values[-1])
    if "heads/induction/top" in series:
        job.induction_curve = series["heads/induction/top"]
    job.curves = {key: series[key] for key in intervention_report.CURVES if key in series}
    job.values.update(intervention_report.circuit_values(series))
    for key in sorted(series):
        if key.startswith("circuit/K/") and not key.endswith(("_minus_baseline", "_rank")):
            job.values[f"K_{key.removeprefix('circuit/K/')}"] = float(series[key][1][-1])
    for key, value in summary.items():
        if key.startswith("validity/") and key.endswith("/final_spearman_loss"):
            job.values[f"spearman_{key.split('/')[1]}"] = value
    job.values.update(switch_values(summary))
    for key, value in summary.items():
        if key.startswith("strategies/stage/"):  # strategies/stage/NAME/truth_kl: the stage's plateau
            job.values[f"{key.split('/')[2]} stage truth_kl"] = value
    if "final/strategies/kl/truth" in summary:
        job.values["final truth_kl"] = summary["final/strategies/kl/truth"]


def switch_values(summary: dict) -> dict[str, float]:
    """``switch uniform->unigram``: the step of each strategy switch in a run's summary
    (:mod:`reports.strategy_timeline`; a second switch between the same two strategies gets `` #2``)."""
    values: dict[str, float] = {}
    i = 1
    while f"strategies/switch/{i}" in summary:
        column = base = "switch " + str(summary[f"strategies/switch/{i}"]).replace(" → ", "->")
        repeat = 1
        while column in values:
            repeat += 1
            column = f"{base} #{repeat}"
        values[column] = float(summary[f"strategies/switch/{i}/step"])
        i += 1
    return values


WANDB_IGNORED = ("logger.", "trainer.enable_progress_bar", "trainer.progress_every_n_steps", "resume", "_wandb")


def read_wandb_jobs(files: list[Path]) -> list[Job]:
    """Jobs known only by their W&B offline run files (``run-ID.wandb``, e.g. copied from a cluster):
    the files of one run id (a resumed run has several) make one job. Its overrides are the config
    values that differ between the runs given; its status comes from the W&B exit code."""
    by_id: dict[str, list[Path]] = {}
    for path in sorted(files, key=lambda f: f.parent.name):  # offline-run-DATE_TIME-ID: start order
        by_id.setdefault(wandb_records.run_id(path), []).append(path)
    jobs, configs = [], []
    for paths in by_id.values():
        config, rows = {}, []
        for path in paths:
            config.update(wandb_records.config(path))
            rows += wandb_records.history(path)
        flat = {k: v for k, v in flatten(config).items() if not k.startswith(WANDB_IGNORED)}
        code = wandb_records.exit_code(paths[-1])
        status = "running" if code is None else FINISHED if code == 0 else "preempted" if code > 128 else "failed"
        job = Job(paths[-1].parent, {}, status, "" if code in (0, None) else f"W&B exit code {code}", config=config)
        fill_values(job, flat.get("seed", ""), history_series(rows), wandb_records.summary(paths[-1]))
        job.values["circuit_pair"] = ""
        jobs.append(job)
        configs.append(flat)
    for job, flat in zip(jobs, configs):
        job.overrides = {k: str(v) for k, v in flat.items() if len({str(c.get(k)) for c in configs}) > 1}
    return jobs


def history_series(rows: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{key: (steps, values)}`` over W&B history rows, stepped by ``trainer/global_step``, under the
    tracker's key names (the CSV's: W&B's section prefixes undone, :func:`records.wandb_sections.tracker_key`)."""
    points: dict[str, dict[int, float]] = {}
    for row in rows:
        step = row.get(STEP_KEY)
        if step is None:
            continue
        for key, value in row.items():
            if isinstance(value, (int, float)) and not key.startswith("_"):
                points.setdefault(tracker_key(key), {})[int(step)] = float(value)
    return {
        key: (np.array(sorted(by_step)), np.array([by_step[s] for s in sorted(by_step)]))
        for key, by_step in points.items()
    }


def final_circuit_pair(run_dir: Path) -> str:
    """The circuit pair at the last snapshot, ``L0H1->L1H0``, from the tensor store ('' without one)."""
    store = run_dir / TENSORS_DIR
    if not (store / INDEX_NAME).is_file():
        return ""
    scores = read_tensor_store(store, ["heads/prev_token", "heads/induction"])
    if len(scores) < 2 or not len(scores["heads/induction"][0]) or scores["heads/induction"][1].shape[1] < 2:
        return ""
    import torch

    (l1, h1), (l2, h2) = circuit_pair(
        torch.from_numpy(scores["heads/prev_token"][1][-1]), torch.from_numpy(scores["heads/induction"][1][-1])
    )
    return f"L{l1}H{h1}->L{l2}H{h2}"


def keys_varying_across(jobs: list[Job]) -> list[str]:
    """The overrides whose values differ between jobs, seeds last."""
    keys = sorted({k for job in jobs for k in job.overrides})
    varying = [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]
    return [k for k in varying if k not in SEED_KEYS] + [k for k in varying if k in SEED_KEYS]


def job_rows(jobs: list[Job], swept: list[str]) -> list[dict]:
    columns = sorted({k for job in jobs for k in job.values}, key=_column_order)
    return [
        {
            "job": job.run_dir.name,
            **{k: job.overrides.get(k, "") for k in swept},
            "status": job.status,
            **{c: job.values.get(c, "") for c in columns},
        }
        for job in jobs
    ]


def _column_order(column: str) -> tuple[int, str]:
    first = (
        "seed",
        "phase_change_onset",
        "phase_change_midpoint",
        "phase_change_end",
        "phase_change_why",
        "repeated_loss_start",
        "repeated_loss_end",
        "top_induction_score",
        "circuit_pair",
        "intervention",
    )
    return (first.index(column), "") if column in first else (len(first) + (column.startswith("spearman_")), column)


def group_rows(jobs: list[Job], swept: list[str]) -> list[dict]:
    """Per combination of the non-seed swept values: n jobs, n finished, and mean ± sd of each number
    over the finished jobs (the seeds)."""
    settings = [k for k in swept if k not in SEED_KEYS]
    groups: dict[tuple, list[Job]] = {}
    for job in jobs:
        groups.setdefault(tuple(job.overrides.get(k, "") for k in settings), []).append(job)
    numeric = sorted(
        {k for job in jobs for k, v in job.values.items() if isinstance(v, (int, float)) and k != "seed"},
        key=_column_order,
    )
    rows = []
    for values, members in groups.items():
        done = [job for job in members if job.status == FINISHED]
        row = {**dict(zip(settings, values)), "jobs": len(members), "finished": len(done)}
        for column in numeric:
            numbers = np.array(
                [float(job.values[column]) for job in done if isinstance(job.values.get(column), (int, float))],
                dtype=float,
            )
            numbers = numbers[np.isfinite(numbers)]
            row[f"{column}_mean"] = float(numbers.mean()) if len(numbers) else math.nan
            row[f"{column}_sd"] = float(numbers.std(ddof=1)) if len(numbers) > 1 else math.nan
        rows.append(row)
    return rows


def format_table(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.4g}"
        return str(value)

    cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def draw_loss_curves(jobs: list[Job], colour_by: str | None, path: Path) -> None:
    """Every job's repeated-token loss over training, one colour per value of ``colour_by``."""
    from reports.plots import plt  # here: reading a sweep (the explorer) loads no plotting library

    fig, ax = plt.subplots(figsize=(7, 4.2))
    values = sorted({job.overrides.get(colour_by, "") for job in jobs}, key=_numeric_first) if colour_by else [""]
    colours = plt.get_cmap("viridis")(np.linspace(0.05, 0.9, max(len(values), 1)))
    labelled = set()
    for job in jobs:
        if job.loss_curve is None:
            continue
        value = job.overrides.get(colour_by, "") if colour_by else ""
        colour = colours[values.index(value)]
        label = f"{colour_by}={value}" if colour_by and value not in labelled else None
        labelled.add(value)
        ax.plot(
            *job.loss_curve, color=colour, lw=1.2, alpha=0.85, label=label, ls="-" if job.status == FINISHED else ":"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss on repeated tokens")
    ax.set_title(f"{len(jobs)} jobs" + (f", coloured by {colour_by}" if colour_by else "") + " (dotted: not finished)")
    if labelled - {""}:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_aligned(jobs: list[Job], colour_by: str | None, path: Path) -> None:
    """Every job's repeated-token loss and top induction score against the step relative to its own
    phase-change midpoint, so that the shape of the change can be compared across seeds, not only its timing."""
    from reports.plots import plt

    fig, (ax_loss, ax_induction) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    values = sorted({job.overrides.get(colour_by, "") for job in jobs}, key=_numeric_first) if colour_by else [""]
    colours = plt.get_cmap("viridis")(np.linspace(0.05, 0.9, max(len(values), 1)))
    drawn, labelled = 0, set()
    for job in jobs:
        midpoint = job.values.get("phase_change_midpoint", math.nan)
        if job.loss_curve is None or not isinstance(midpoint, (int, float)) or not math.isfinite(midpoint):
            continue
        value = job.overrides.get(colour_by, "") if colour_by else ""
        label = f"{colour_by}={value}" if colour_by and value not in labelled else None
        labelled.add(value)
        style = {
            "color": colours[values.index(value)],
            "lw": 1.2,
            "alpha": 0.85,
            "ls": "-" if job.status == FINISHED else ":",
        }
        ax_loss.plot(job.loss_curve[0] - midpoint, job.loss_curve[1], label=label, **style)
        if job.induction_curve is not None:
            ax_induction.plot(job.induction_curve[0] - midpoint, job.induction_curve[1], **style)
        drawn += 1
    for ax, ylabel in ((ax_loss, "loss on repeated tokens"), (ax_induction, "top induction score")):
        ax.axvline(0, color="k", lw=0.6, ls="--")
        ax.set_xlabel("step - the job's phase-change midpoint")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if labelled - {""}:
        ax_loss.legend(fontsize=8)
    fig.suptitle(f"{drawn} of {len(jobs)} jobs aligned on their own midpoint (the others show no phase change)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_midpoints(jobs: list[Job], settings: list[str], path: Path) -> None:
    """The phase-change midpoint against each swept setting: mean and standard deviation over seeds."""
    from reports.plots import plt

    fig, axes = plt.subplots(1, max(len(settings), 1), figsize=(4.5 * max(len(settings), 1), 3.8), squeeze=False)
    for ax, setting in zip(axes[0], settings or [None]):
        by_value: dict[str, list[float]] = {}
        for job in jobs:
            midpoint = job.values.get("phase_change_midpoint", math.nan)
            if job.status == FINISHED and isinstance(midpoint, (int, float)) and math.isfinite(midpoint):
                by_value.setdefault(job.overrides.get(setting, "") if setting else "all", []).append(float(midpoint))
        labels = sorted(by_value, key=_numeric_first)
        means = [np.mean(by_value[v]) for v in labels]
        spreads = [np.std(by_value[v], ddof=1) if len(by_value[v]) > 1 else 0.0 for v in labels]
        positions = (
            [float(v) for v in labels] if labels and all(_is_number(v) for v in labels) else list(range(len(labels)))
        )
        ax.errorbar(positions, means, yerr=spreads, fmt="o-", capsize=4)
        for x, v in zip(positions, labels):
            ax.annotate(
                f"n={len(by_value[v])}",
                (x, np.mean(by_value[v])),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=7,
            )
        if positions and not all(_is_number(v) for v in labels):
            ax.set_xticks(positions, labels)
        ax.set_xlabel(setting or "")
        ax.set_ylabel("phase-change midpoint (step)")
        if not labels:
            ax.text(0.5, 0.5, "no phase change detected", transform=ax.transAxes, ha="center")
    fig.suptitle("phase-change midpoint, mean ± sd over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _numeric_first(text: str) -> tuple[int, float, str]:
    return (0, float(text), "") if _is_number(text) else (1, 0.0, text)


@dataclass
class SweepReport:
    directory: Path
    jobs: list[Job]
    swept: list[str]
    job_table: list[dict]
    group_table: list[dict]
    analysis_columns: list[str] = field(default_factory=list)  # the analysis's own columns, in its order
    analysis_title: str = ""
    training_validity: list[dict] = field(default_factory=list)  # with interventions: intervention_report
    drawn: bool = True  # its figures drawn (a sweep run with figures=false: its tables only)

    @property
    def intervened(self) -> bool:
        """Whether any job trained with an intervention."""
        return any(job.values.get("intervention", "none") != "none" for job in self.jobs)

    @property
    def failed(self) -> list[Job]:
        return [job for job in self.jobs if job.status != FINISHED]

    def figures(self) -> list[str]:
        """The names of the figures the report draws (drawn or not)."""
        return [
            SWEEP_CURVES_FIGURE,
            SWEEP_MIDPOINTS_FIGURE,
            SWEEP_ALIGNED_FIGURE,
            *((SWEEP_INTERVENTIONS_FIGURE,) if self.intervened else ()),
        ]

    def files(self) -> dict[str, Path]:
        return {
            name: self.directory / name
            for name in (
                SWEEP_JOBS_TABLE,
                SWEEP_GROUPS_TABLE,
                SWEEP_CURVES_FIGURE,
                SWEEP_MIDPOINTS_FIGURE,
                SWEEP_ALIGNED_FIGURE,
                *((SWEEP_INTERVENTIONS_FIGURE, SWEEP_TRAINING_VALIDITY) if self.intervened else ()),
            )
        }


def read_jobs(paths: list[Path]) -> list[Job]:
    """The jobs under ``paths``: run directories, else W&B offline runs (:func:`read_wandb_jobs`).
    Raises FileNotFoundError when there are neither."""
    return read_jobs_and_analyses([Path(p) for p in paths])[0]


def read_jobs_and_analyses(paths: list[Path], analysis: str | None = None) -> tuple[list[Job], list[dict]]:
    """:func:`read_jobs`, and each job's analysis ``analysis`` record that has columns."""
    read = [read_job(d, analysis) for d in job_dirs(paths)]
    jobs = [job for job, _ in read]
    records = [record for _, record in read if record.get("columns")]
    if not jobs:  # no train.py run directories: W&B offline runs, then
        jobs = read_wandb_jobs(
            [
                f
                for p in paths
                for f in (
                    p.glob("run-*.wandb")
                    if p.name.startswith("offline-run-")
                    else p.glob("**/offline-run-*/run-*.wandb")
                )
            ]
        )
    if not jobs:
        raise FileNotFoundError(
            f"no run directories (with .hydra/overrides.yaml) or W&B offline runs under {', '.join(map(str, paths))}"
        )
    return jobs, records


def sweep_report(
    paths: list[Path], out_dir: Path | None = None, analysis: str | None = None, figures: bool = True
) -> SweepReport:
    """Read the jobs under ``paths`` and write the tables and figures into ``out_dir`` (default: the
    first path); ``analysis``: with each job's analysis of that name (``analysis/NAME/``: its columns,
    or a re-scoring's numbers), where it has one; without ``figures``, the tables alone (a sweep run
    with ``figures=false``, as a run's end draws none). Raises FileNotFoundError when there is no run
    directory under ``paths``."""
    paths = [Path(p) for p in paths]
    jobs, records = read_jobs_and_analyses(paths, analysis)
    swept = keys_varying_across(jobs)
    settings = [k for k in swept if k not in SEED_KEYS]
    first = paths[0] if paths[0].is_dir() and not paths[0].name.startswith("offline-run-") else paths[0].parent
    report = SweepReport(Path(out_dir or first), jobs, swept, job_rows(jobs, swept), group_rows(jobs, swept))
    report.drawn = figures
    report.analysis_columns = list(dict.fromkeys(column for record in records for column in record["columns"]))
    report.analysis_title = next((record["columns_title"] for record in records if record.get("columns_title")), "")
    report.directory.mkdir(parents=True, exist_ok=True)
    files = report.files()
    write_rows(files[SWEEP_JOBS_TABLE], report.job_table)
    write_rows(files[SWEEP_GROUPS_TABLE], report.group_table)
    colour_by = settings[0] if settings else (swept[0] if swept else None)
    if figures:
        draw_loss_curves(jobs, colour_by, files[SWEEP_CURVES_FIGURE])
        draw_aligned(jobs, colour_by, files[SWEEP_ALIGNED_FIGURE])
        draw_midpoints(jobs, settings, files[SWEEP_MIDPOINTS_FIGURE])
    if report.intervened:
        if figures:
            intervention_report.draw_groups(jobs, settings, files[SWEEP_INTERVENTIONS_FIGURE])
        report.training_validity = intervention_report.validity_rows(jobs, settings)
        write_rows(files[SWEEP_TRAINING_VALIDITY], report.training_validity)
    return report


def print_sweep_report(report: SweepReport) -> None:
    brief = [
        "job",
        *report.swept,
        "status",
        "phase_change_midpoint",
        "repeated_loss_start",
        "repeated_loss_end",
        "top_induction_score",
        "circuit_pair",
        "K_frobenius",
        "K_share",
    ]
    print(
        f"\nsweep: {len(report.jobs)} jobs in {report.directory} ({len(report.failed)} not finished); full table {report.files()[SWEEP_JOBS_TABLE]}"
    )
    switches = sorted({c for row in report.job_table for c in row if c.startswith("switch ") or c.endswith("truth_kl")})
    brief += switches
    print(format_table(report.job_table, [c for c in brief if any(c in row for row in report.job_table)]))
    settings = [k for k in report.swept if k not in SEED_KEYS]
    group_columns = [
        *settings,
        "jobs",
        "finished",
        "phase_change_midpoint_mean",
        "phase_change_midpoint_sd",
        "repeated_loss_end_mean",
        "repeated_loss_end_sd",
        "top_induction_score_mean",
        *(f"{c}_{stat}" for c in switches for stat in ("mean", "sd")),
    ]
    print(f"\nover seeds ({report.files()[SWEEP_GROUPS_TABLE]}):")
    print(format_table(report.group_table, [c for c in group_columns if any(c in row for row in report.group_table)]))
    print_analysis(report)
    if report.training_validity:
        print(
            f"\ntraining-time validity: does each measure read circuit (above its null) where the circuit formed"
            f" (its K-only ablation moves >= {intervention_report.CIRCUIT_PATTERN} of the reader's attention), and not where it did not?"
            f" ({report.files()[SWEEP_TRAINING_VALIDITY]})"
        )
        print(format_table(report.training_validity, list(report.training_validity[0])))
    if report.drawn:
        print(f"figures: {', '.join(str(report.files()[name]) for name in report.figures())}")
    else:
        print(f"figures: none (figures=false); python -m reports.sweep_report {report.directory} draws them")
    for job in report.failed:
        print(
            f"not finished: job {job.run_dir.name} ({' '.join(f'{k}={v}' for k, v in job.overrides.items())}): {job.status}"
            + (f": {job.error}" if job.error else "")
        )


def print_analysis(report: SweepReport) -> None:
    """The analysis's columns for each job, and over its seeds the mean ± sd of those that are numbers."""
    columns = report.analysis_columns
    if not columns:
        return
    print(f"\n{report.analysis_title or 'the analysis'}:")
    first = ["job", *report.swept, *(["seed"] if "seed" not in report.swept else []), "phase_change_midpoint"]
    print(format_table(report.job_table, [*first, *columns]))
    numeric = [c for c in columns if any(f"{c}_mean" in row for row in report.group_table)]
    for row in report.group_table:
        spread = []
        for name in numeric:
            mean, sd = row.get(f"{name}_mean", math.nan), row.get(f"{name}_sd", math.nan)
            if math.isfinite(mean):
                spread.append(f"{name} {mean:.4g} ± {sd:.2g}" if math.isfinite(sd) else f"{name} {mean:.4g}")
        label = " ".join(f"{k}={row[k]}" for k in report.swept if k in row and k not in SEED_KEYS) or "all jobs"
        print(f"over seeds ({label}): {', '.join(spread) or 'no values'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "paths", type=Path, nargs="+", help="a sweep directory (multirun/DATE/TIME), or run directories"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write the tables and figures (default: the first path)"
    )
    parser.add_argument(
        "--analysis",
        default=None,
        metavar="NAME",
        help="with each job's analysis/NAME/ (python -m analysis.*): its columns, or a re-scoring's numbers",
    )
    args = parser.parse_args(argv)
    try:
        report = sweep_report(args.paths, args.out, args.analysis)
    except (FileNotFoundError, wandb_records.WandbFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print_sweep_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
