"""The LLC during training (``stages.llc.every_n_steps``): real ``train.py`` runs."""

from __future__ import annotations

import sys

import pytest
import torch

from conf.objects import llc_sequences, sgld_settings
from records.trajectory import Trajectory
from reports.run_report import read_series
from tests.helpers import TINY, composed, require_extra, run_train

pytestmark = pytest.mark.slow

QUICK = ["stages.llc.chains=2", "stages.llc.draws=12", "stages.llc.burnin=4", "stages.llc.batches=2"]


def test_llc_every_n_steps_is_logged_and_leaves_training_unchanged(tmp_path):
    require_extra("devinterp", "llc")
    from metrics.dynamics.llc import llc_record
    from metrics.dynamics.refined_llc import group_masks

    # one thread: bit-identical losses; two micro-batches a step: the callback runs twice per step
    both = ["trainer.num_threads=1", "tracker.num_threads=1", "trainer.accumulate_grad_batches=2"]
    with_llc = run_train([*TINY, *both, "stages.llc.every_n_steps=30", *QUICK], tmp_path / "with")
    assert with_llc.returncode == 0, with_llc.stderr[-3000:]
    without = run_train([*TINY, *both], tmp_path / "without")
    assert without.returncode == 0, without.stderr[-3000:]
    logged = read_series(tmp_path / "with" / "csv" / "metrics.csv")
    assert list(logged["llc/mean"][0]) == [30.0, 60.0] and all(logged["llc/std"][1] >= 0)
    for group in ("L0H0", "L0H1", "L1H0", "L1H1", "L0", "L1"):  # every head and layer (stages.llc.heads)
        assert list(logged[f"llc/{group}"][0]) == [30.0, 60.0], group
    # a head's and a layer's λ̂ at step 60 against devinterp's own sample with that group's mask on the weights
    # saved then, the same sequences and settings (float32: to the trace's resolution, nβ · eps32 · L(w*))
    cfg = composed(*TINY, *both, "stages.llc.every_n_steps=30", *QUICK)
    model, settings = Trajectory(tmp_path / "with").model(60), sgld_settings(cfg.stages.llc)
    for group in ("L1H0", "L0"):
        masks = group_masks(model, group)
        theirs = llc_record(model, llc_sequences(cfg), settings, cfg.stages.llc.settle_tolerance, masks)
        resolution = settings.n_beta * torch.finfo(torch.float32).eps * theirs["init_loss"]
        assert logged[f"llc/{group}"][1][-1] == pytest.approx(theirs["mean"], rel=1e-5, abs=resolution), group
    assert "llc: λ̂" in (tmp_path / "with" / "train.log").read_text()
    plain = read_series(tmp_path / "without" / "csv" / "metrics.csv")
    for key in ("train/loss", "loss/repeated"):  # devinterp reseeds the global RNGs: they are restored
        assert list(logged[key][1]) == list(plain[key][1]), key


def test_without_the_extra_llc_during_training_is_a_config_error(tmp_path, monkeypatch):
    """devinterp made unimportable (None in sys.modules), as on an install without the extra."""
    monkeypatch.setitem(sys.modules, "devinterp", None)
    result = run_train(["stages.llc.every_n_steps=10"], tmp_path / "run")
    assert result.returncode != 0 and not (tmp_path / "run").exists()
    assert (
        "config error: stages.llc.every_n_steps=10: the local learning coefficient needs devinterp, the 'llc' extra"
        in (result.stdout + result.stderr)
    )
