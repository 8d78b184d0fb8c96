"""Re-scoring a finished run from its saved weights, and opening them in TransformerLens: real
``train.py`` runs, then ``python -m analysis.rescore`` / ``analysis.export`` as a user runs them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from records import wandb_records
from records.trajectory import Trajectory
from reports.run_report import read_series
from tests.helpers import TINY, digest, module, require_extra, run_train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tiny_run):
    assert tiny_run.returncode == 0, tiny_run.stderr[-3000:]
    return tiny_run.run_dir


def test_a_run_keeps_its_planned_steps(trained):
    trajectory = Trajectory(trained)
    assert {0, 1, 30, 60} <= set(trajectory.steps)
    assert trajectory.config["trainer"]["max_steps"] == 60 and trajectory.shape.n_heads == 2
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["trajectory/steps"] == len(trajectory.steps)


def test_rescore_equals_training_writes_only_its_analysis_and_never_replaces_one(trained):
    before = digest(trained)
    result = module("analysis.rescore", trained, "tracker.measures=[subspace]")
    assert result.returncode == 0, result.stderr[-3000:]
    out = trained / "analysis" / "measures=subspace"
    assert "about" in result.stdout and (out / "validity.csv").is_file()
    assert not list(out.glob("*.png")) and "no figures (figures=false)" in result.stdout  # as its run (NO_FIGURES)
    logged, rescored = read_series(trained / "csv" / "metrics.csv"), read_series(out / "csv" / "metrics.csv")
    compared = 0
    for key in (k for k in logged if "/subspace" in k and k in rescored):
        steps, values = logged[key]
        at = dict(zip(*rescored[key]))
        for step, value in zip(steps, values):
            if step in at:
                assert at[step] == pytest.approx(value, rel=1e-6, abs=1e-9), (key, step)
                compared += 1
    assert compared >= 3 * 4  # the training run's subspace steps (0, 30, 60) x the pairs' K at least
    saved = Trajectory(trained).steps
    assert (
        list(rescored["comp/K/subspace/L0H1->L1H0"][0]) == saved
    )  # a measure training scored thinly, at every saved step
    assert digest(trained) == before  # the training run's files are byte-identical
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    (training_file,) = trained.glob("wandb/offline-run-*/run-*.wandb")
    run, training = (wandb_records.run(f) for f in (run_file, training_file))
    assert (
        run["job_type"] == "analysis" and run["run_group"] == training["display_name"]
    )  # a group named after the training run
    first = digest(out)
    again = module("analysis.rescore", trained, "tracker.measures=[subspace]")
    assert again.returncode == 2 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert digest(out) == first


@pytest.mark.parametrize(
    "args, message",
    [
        (["tracker.nonsense=1"], "nonsense"),
        (["model.n_heads=4"], "only tracker.* options"),
        (["tracker.ablation.kind=sideways"], "sideways"),
        (["--steps", "7"], "step 7 was not saved"),
        (["--steps", "61:90"], "no saved step in that range"),
    ],
)
def test_bad_requests_are_one_line_and_write_nothing(trained, args, message):
    result = module("analysis.rescore", trained, *args, "--name", "bad")
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1 and not (trained / "analysis" / "bad").exists()


def test_damaged_trajectories_are_refused_before_anything_is_written(trained, tmp_path):
    missing = module("analysis.rescore", tmp_path)
    assert missing.returncode == 2 and "has no trajectory/index.json" in missing.stderr
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy, ignore=shutil.ignore_patterns("analysis"))
    victim = copy / "trajectory" / "step-00000030.safetensors"
    victim.write_bytes(victim.read_bytes()[:200])
    truncated = module("analysis.rescore", copy)
    assert truncated.returncode == 2 and "bytes where the index says" in truncated.stderr
    assert not (copy / "analysis").exists()


def test_export_opens_in_transformer_lens_with_our_logits_and_logged_composition(trained, tmp_path):
    require_extra("transformer_lens", "tl")
    from analysis.export import load_exported

    result = module("analysis.export", trained, "--step", 30, "--out", tmp_path / "tl")
    assert result.returncode == 0, result.stderr[-3000:]
    tl_model = load_exported(tmp_path / "tl")
    ours = Trajectory(trained).model(30)
    tokens = torch.randint(0, ours.shape.d_vocab, (4, ours.shape.n_ctx), generator=torch.Generator().manual_seed(0))
    assert (tl_model(tokens) - ours(tokens)).abs().max() <= 1e-5
    with torch.no_grad():
        scores = tl_model.all_composition_scores("K")
    scores = getattr(scores, "scores", scores)  # TransformerLens 4: a CompositionScores holding them
    logged = read_series(trained / "csv" / "metrics.csv")
    for writer in range(2):
        for reader in range(2):
            steps, values = logged[f"comp/K/frobenius/L0H{writer}->L1H{reader}"]
            assert float(scores[0, writer, 1, reader]) == pytest.approx(
                float(values[np.flatnonzero(steps == 30)[0]]), rel=1e-5
            )
    refused = module("analysis.export", trained, "--step", 30, "--out", tmp_path / "tl")
    assert refused.returncode == 2 and "not an empty directory" in refused.stderr


def test_seed_002s_library_options_train_track_and_open_in_transformer_lens(tmp_path):
    """Shortformer positions, biases and EasyTransformer's init, in a real run (the ablation off: it
    does not handle them yet), exported at its last step with TransformerLens 3's logits equal to
    ours; TransformerLens 4, which has no shortformer positions, says so in one line."""
    require_extra("transformer_lens", "tl")
    from analysis.export import load_hooked_transformer, transformer_lens_major

    run_dir = tmp_path / "run"
    result = run_train(
        [
            *TINY,
            "trainer.max_steps=20",
            "model.positions=shortformer",
            "model.biases=true",
            "model.init=gpt2",
            "model.normalization=layernorm",
            "tracker.ablation.every_n_steps=0",
            "logger=csv",
        ],
        run_dir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trajectory = Trajectory(run_dir)
    assert trajectory.shape.positions == "shortformer" and trajectory.shape.biases
    ours = trajectory.model(20).double()
    if transformer_lens_major() >= 4:
        with pytest.raises(ValueError, match="no shortformer positions: this model opens in TransformerLens 3"):
            load_hooked_transformer(run_dir, 20, dtype=torch.float64)
        return
    tl_model = load_hooked_transformer(run_dir, 20, dtype=torch.float64)
    tokens = torch.randint(0, ours.shape.d_vocab, (4, ours.shape.n_ctx), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (tl_model(tokens) - ours(tokens)).abs().max() <= 1e-10
    assert float(ours.layers[0].b_K.detach().abs().max()) > 0  # the biases trained


def test_a_thinned_step_selection_still_ends_at_the_last_saved_step():
    from analysis.saved_run import select_steps

    saved = [0, 10, 20, 30, 40]
    assert select_steps(saved, "all", 3) == [0, 30, 40]
    assert select_steps(saved, "all", 2) == [0, 20, 40]
    assert select_steps(saved, "10:30", 5) == [10, 30]
