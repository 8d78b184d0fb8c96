"""The saved W&B workspace: every panel it would write names keys that real train.py runs log (the
default run and a 4 x 8 x 256 x 32 one in summary mode), and --dry-run prints it and saves nothing."""

from __future__ import annotations

import re

import pytest

from records import wandb_records
from reports.wandb_workspace import SECTIONS, build_workspace
from tests.helpers import WITH_WANDB, module, run_train

pytestmark = pytest.mark.slow

BIG = [  # 4 x 8 x 256 x 32, every part at its two steps, so every key it can log is logged
    "model.n_layers=4",
    "model.n_heads=8",
    "model.d_model=256",
    "model.d_head=32",
    "trainer.max_steps=2",
    "trainer.log_every_n_steps=1",
    "tracker.every_n_steps=1",
    "tracker.all_measures.every_n_steps=1",
    "tracker.whitening.every_n_steps=1",
    "tracker.ablation.every_n_steps=1",
    "tracker.writes.every_n_steps=1",
    "tracker.matching.every_n_steps=1",
    "tracker.images.every_n_steps=1",
    "tracker.baseline_samples=50",
    "figures=true",  # the report's images have their panels too
    "explorer=true",  # and the run's page
    WITH_WANDB,
]


def logged(run_dir) -> tuple[set[str], dict]:
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return {key for row in wandb_records.history(run_file) for key in row}, wandb_records.summary(run_file)


def missing_keys(keys: set[str], summary: dict) -> list[str]:
    """Every panel's key (or pattern) that the run did not log, named by section and panel."""
    missing = []
    for section in SECTIONS:
        for panel in section.panels:
            if panel.regex is not None:
                found = any(re.match(panel.regex, key) for key in keys)
            elif panel.kind == "chart":
                found = f"{panel.keys[0]}_table/path" in keys
            elif panel.kind == "media":
                found = all(f"{key}/_type" in keys for key in panel.keys)
            elif panel.kind == "scatter":
                found = panel.keys[0] in summary
            else:
                found = set(panel.keys) <= keys
            if not found:
                missing.append(f"{section.name} / {panel.title}: {panel.regex or panel.keys}")
    return missing


def test_every_panel_names_keys_a_default_run_and_a_big_run_log(shipped_run, tmp_path):
    assert shipped_run.returncode == 0, shipped_run.stderr[-3000:]  # python train.py: 1500 steps, a phase change
    assert missing_keys(*logged(shipped_run.run_dir)) == []
    big = run_train(BIG, tmp_path / "big")
    assert big.returncode == 0, big.stderr[-3000:]
    keys, summary = logged(tmp_path / "big")
    assert not [key for key in keys if "->" in key]  # summary mode: the per-pair panels match max / mean
    # no cliff in its few steps: no midpoint, and no forecast (its loss never fell 1 % of its first level)
    assert missing_keys(keys, summary) == [
        "Phase change / forecast of the loss's midpoint step, and its 80 % interval:"
        " ('forecast/midpoint_step', 'forecast/low', 'forecast/high')",
        "Phase change / forecast: p that the phase change comes by max_steps: ('forecast/p_before_end',)",
        "Sweep / the cliff's midpoint step: ('phase_change/loss_midpoint_step',)",
    ]


def test_a_renamed_key_is_caught():
    keys = {"1_story/loss/repeated"}
    assert any("repeated vs first-occurrence" in line for line in missing_keys(keys, {}))


def test_dry_run_prints_the_workspace_and_saves_nothing():
    workspace = build_workspace("someone", "induction-composition", "story", ["model.n_heads", "seed"])
    assert [s.name for s in workspace.sections] == ["Phase change", "Composition", "Ground truth", "Per pair", "Sweep"]
    assert workspace.sections[0].is_open and not workspace.sections[3].is_open
    assert len(workspace.sections[4].panels) == 2 + 2  # two grouped line plots, one scatter per swept key
    bare = {"WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}  # no W&B key, offline: a user without an account
    result = module("reports.wandb_workspace", "--entity", "e", "--project", "p", "--dry-run", environ=bare)
    assert result.returncode == 0, result.stderr
    assert (
        "Phase change (open): 11 panels" in result.stdout
        and "media_keys=['explorer']" in result.stdout
        and "1_story/loss/repeated" in result.stdout
    )
    missing = module("reports.wandb_workspace", "--project", "p")
    assert missing.returncode == 2 and "--entity" in missing.stderr
