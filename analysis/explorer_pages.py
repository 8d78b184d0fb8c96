"""The explorer pages' writers (the command is :mod:`analysis.explorer`): a run's ``explorer.html``,
one self-contained page with one step slider (:mod:`reports.explorer_page`) and every head's attention
pattern on one probe sequence computed here from the trajectory's weights (with the run's
interventions on where they were, as it trained); a sweep's page over its members. A run writes its
page at its end too (``explorer=false`` turns that off)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from analysis.saved_run import AnalysisError, SavedInterventions, run_config
from conf.objects import build_probe
from data.task import tasks
from records.layout import CSV_RELATIVE_PATH, EMERGENCE_RECORD, HYDRA_CONFIG, HYDRA_DIR, DamagedFile, run_label
from records.trajectory import Trajectory, TrajectoryError
from reports.explorer_page import (
    MAX_PATTERN_TOKENS,
    PATTERN_BUDGET,
    Patterns,
    default_page,
    emergence_section,
    pattern_heads,
    run_page,
    sweep_page,
    within,
    write_page,
)
from reports.run_report import read_series
from reports.sweep_report import SEED_KEYS, keys_varying_across, read_job


def probe_sequence(trajectory: Trajectory) -> tuple[torch.Tensor, int]:
    """The tracker's first probe sequence (the task's, as the run built it) cut to its first
    :data:`~reports.explorer_page.MAX_PATTERN_TOKENS` tokens ``[T]``, and its whole length."""
    tokens = build_probe(run_config(trajectory, [], None)).tokens
    return tokens[0, :MAX_PATTERN_TOKENS].clone(), tokens.shape[1]


@torch.no_grad()
def attention_patterns(trajectory: Trajectory) -> Patterns:
    """Every drawn head's attention on :func:`probe_sequence` at the saved steps the page's budget keeps."""
    tokens, probe_length = probe_sequence(trajectory)
    shape = trajectory.shape
    heads, head_note = pattern_heads(shape.n_layers, shape.n_heads)
    T = len(tokens)
    keep, step_note = within(
        np.array(trajectory.steps), len(heads) * T * (T + 1) // 2 * 4, PATTERN_BUDGET, "attention patterns"
    )
    steps = [trajectory.steps[i] for i in keep]
    interventions = SavedInterventions.of(trajectory)
    values = np.empty((len(steps), len(heads), T, T), dtype=np.float32)
    layers, index = torch.tensor([l for l, _ in heads]), torch.tensor([h for _, h in heads])
    model = trajectory.model(steps[0])
    for n, step in enumerate(steps):
        model.load_state_dict(trajectory.state_dict(step))  # into the one model: building one costs more
        model.set_changes(interventions.changes_at(step))
        _, cache = model.run_with_cache(tokens[None], head_out=False)
        every = torch.stack(cache["pattern"])[:, 0]  # [L, H, T, T]
        values[n] = every[layers, index].float().numpy()
    notes = [note for note in (head_note, step_note) if note]
    if probe_length > T:
        notes.append(f"attention patterns: the probe sequence's first {T} of its {probe_length} tokens")
    if interventions.plan:
        notes.append(f"attention patterns with the run's interventions on where they were: {interventions.description}")
    return Patterns(steps, tokens.tolist(), heads, values, notes)


def reader_of(run_dir: Path) -> str:
    """The run's task's reader behaviour (prefix matching's name on it), from its saved config (the
    trajectory's, else Hydra's); ``induction`` when neither names a known task."""
    hydra_config = run_dir / HYDRA_DIR / HYDRA_CONFIG
    try:
        config = Trajectory(run_dir).config
    except TrajectoryError:
        try:
            config = yaml.safe_load(hydra_config.read_text()) if hydra_config.is_file() else {}
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            print(f"{DamagedFile(hydra_config, error)}: the page reads the task as repeated tokens", file=sys.stderr)
            config = {}
    task = tasks().get(str(((config or {}).get("data") or {}).get("name"))) if isinstance(config, dict) else None
    return task.reader_behaviour if task is not None else "induction"


def write_run_page(run_dir: Path, out: Path | None = None) -> tuple[Path, int, float]:
    """Write the run's page (``RUN_DIR/explorer.html`` unless ``out``); returns (path, bytes, seconds)."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    patterns, why = None, None
    try:
        patterns = attention_patterns(Trajectory(run_dir))
    except TrajectoryError as error:
        why = f"no attention patterns: {error}"
    except AnalysisError as error:
        why = f"no attention patterns: the probe could not be rebuilt ({error})"
    data = run_page(run_dir, patterns, why, reader_of(run_dir))
    path = Path(out) if out is not None else default_page(run_dir)
    size = write_page(path, data)
    return path, size, time.perf_counter() - started


def write_sweep_page(sweep_dir: Path, members: list[Path], out: Path | None = None) -> tuple[Path, int, float]:
    """Write the sweep's page over ``members`` (each links to its own ``explorer.html``), grouped as
    the sweep report groups them; returns (path, bytes, seconds)."""
    started = time.perf_counter()
    jobs = [read_job(member)[0] for member in members]
    swept = keys_varying_across(jobs)
    settings = [key for key in swept if key not in SEED_KEYS]
    path = Path(out) if out is not None else default_page(sweep_dir)
    entries = []
    for job in jobs:
        csv_path = job.run_dir / CSV_RELATIVE_PATH
        series = read_series(csv_path) if csv_path.is_file() and csv_path.stat().st_size else {}
        group = ", ".join(f"{key}={job.overrides.get(key, '')}" for key in settings)
        href = os.path.relpath(default_page(job.run_dir).resolve(), path.parent.resolve())
        change = [job.values.get(f"phase_change_{part}", math.nan) for part in ("onset", "midpoint", "end")]
        entries.append(
            {
                "name": job.run_dir.name,
                "href": str(href),
                "group": group,
                "status": job.status,
                "seed": str(job.values.get("seed", "")),
                "phase_change": [None if not isinstance(x, float) or math.isnan(x) else round(x, 1) for x in change],
                "series": series,
            }
        )
    size = write_page(path, sweep_page(entries, settings, run_label(sweep_dir), sweep_emergence(sweep_dir)))
    return path, size, time.perf_counter() - started


def sweep_emergence(sweep_dir: Path) -> dict | None:
    """The sweep's emergence law for its page (``emergence.json``: None where the sweep has none; a
    damaged one is said in one line and left out)."""
    path = Path(sweep_dir) / EMERGENCE_RECORD
    if not path.is_file():
        return None
    try:
        return emergence_section(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        print(f"{path}: unreadable ({type(error).__name__}); the page has no emergence section", file=sys.stderr)
        return None
