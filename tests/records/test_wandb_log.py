"""W&B's sections: every tracker key lands in one, the story fits a page, and the prefix undoes; W&B's
DataFrame check imports no pandas; its start imports no W&B Launch unless a script staged an input; a
logger built while its run opens leaves W&B to the opening thread."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from records.wandb_lean import (
    LAUNCH_INPUTS,
    answer_dataframe_checks_by_type_name,
    apply_launch_inputs_only_where_staged,
)
from records.wandb_sections import SECTION_NAMES, section_of, story, summary_of, tracker_key, wandb_key
from tests.helpers import REPO, fake_snapshot, snapshot_keys


def test_every_tracker_key_has_a_section_and_round_trips():
    for shape in ((2, 2), (4, 8), (12, 12)):  # per-pair mode, and summary mode with and without per-head keys
        keys = snapshot_keys(fake_snapshot(*shape))
        assert all(section_of(key) is not None for key in keys), [k for k in keys if section_of(k) is None]
        assert all(tracker_key(wandb_key(key)) == key for key in keys)
        missing = [e for e in story() if not any(k == e or (e.endswith("/") and k.startswith(e)) for k in keys)]
        assert not missing  # the story is there in either mode


def test_sections_in_reading_order():
    assert wandb_key("loss/repeated") == "1_story/loss/repeated"
    assert wandb_key("circuit/K/subspace") == "2_composition/circuit/K/subspace"
    assert wandb_key("comp/baseline/frobenius") == "2_composition/comp/baseline/frobenius"
    assert wandb_key("validity/loss_change/frobenius/spearman").startswith("3_ground_truth/")
    assert wandb_key("heads/induction/L1H0") == "4_heads/heads/induction/L1H0"
    assert wandb_key("comp/K/frobenius/L0H1->L1H0") == "5_pairs/comp/K/frobenius/L0H1->L1H0"
    assert wandb_key("ablation/loss_change/L0H1->L1H0").startswith("5_pairs/")
    assert [wandb_key(k) for k in ("train/loss", "epoch", "trainer/global_step")] == [
        "train/loss",
        "epoch",
        "trainer/global_step",
    ]
    assert tracker_key("loss/repeated") == "loss/repeated"  # a run logged before the sections
    assert (
        list(SECTION_NAMES) == sorted(SECTION_NAMES) and len(story()) <= 12
    )  # nine keys and the strategies' kl/, closest, weight/


def test_summaries_keep_the_best_value_in_the_right_direction():
    assert summary_of("loss/repeated") == summary_of("loss/icl_score") == "min,last"
    assert summary_of("circuit/K/frobenius_minus_baseline_rank") == "min,last"
    assert summary_of("heads/induction/top") == summary_of("circuit/ablation/loss_change") == "max,last"
    assert summary_of("comp/K/frobenius/L0H1->L1H0") is None


def test_wandb_tells_a_dataframe_without_importing_pandas(monkeypatch):
    import wandb.util

    monkeypatch.setattr(wandb.util, "pd_available", True)  # as where pandas is installed
    monkeypatch.setitem(sys.modules, "pandas", None)  # importing it now raises
    answer_dataframe_checks_by_type_name()
    assert not wandb.util.is_pandas_data_frame(np.zeros(2))
    frame_type = type("DataFrame", (), {"__module__": "pandas.core.frame"})
    assert wandb.util.is_pandas_data_frame(frame_type())


OPEN_A_RUN = """
import sys
import wandb
from records.wandb_lean import lean_wandb
if sys.argv[1] == "lean":
    lean_wandb()
run = wandb.init(project="lean", dir=sys.argv[2], mode="offline")
run.finish()
print(sorted(m for m in ("wandb.sdk.launch", "wandb.apis.public") if m in sys.modules))
"""


@pytest.mark.parametrize("setting, loaded", [("lean", "[]"), ("as_is", "['wandb.apis.public', 'wandb.sdk.launch']")])
def test_a_run_opens_without_w_and_b_launch_where_no_input_is_staged(tmp_path, setting, loaded):
    """A fresh interpreter opens an offline W&B run: with :func:`lean_wandb` neither W&B Launch nor its
    public API is imported; as W&B is (the reference), both are."""
    result = subprocess.run(
        [sys.executable, "-c", OPEN_A_RUN, setting, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == loaded, result.stdout + result.stderr


def test_staged_launch_inputs_are_still_applied(monkeypatch):
    """Where the Launch inputs' module has been imported (a script can have staged an input), W&B's own
    method runs and applies them; where it has not, nothing is imported to look."""
    from wandb.sdk import wandb_run

    applied = []
    monkeypatch.setattr(wandb_run.Run, "_detect_and_apply_job_inputs", lambda run: applied.append(run))
    apply_launch_inputs_only_where_staged()
    apply_launch_inputs_only_where_staged()  # a second call keeps one wrapper
    monkeypatch.delitem(sys.modules, LAUNCH_INPUTS, raising=False)
    wandb_run.Run._detect_and_apply_job_inputs("run without staging")
    assert applied == [] and LAUNCH_INPUTS not in sys.modules
    monkeypatch.setitem(sys.modules, LAUNCH_INPUTS, object())
    wandb_run.Run._detect_and_apply_job_inputs("run with staging")
    assert applied == ["run with staging"]


LOG_WHILE_IT_OPENS = """
import json
import sys
import threading

from conf.lightning_import import import_lightning

import_lightning()
from conf.wandb_run import WandbOpening
from records.wandb_log import SectionedWandbLogger

released = threading.Event()


class HeldOpening(WandbOpening):
    def _open(self):  # the opening thread, held until the logger is built
        released.wait()
        super()._open()


before = "wandb" in sys.modules
opening = HeldOpening(dict(project="race", name="race", id="race0001", dir=sys.argv[1], mode="offline"))
logger = SectionedWandbLogger(opening=opening)
while_opening = sorted(m for m in sys.modules if m == "wandb" or m.startswith("wandb."))
released.set()
run = logger.experiment
import wandb.util
from wandb.sdk import wandb_run

lean = [wandb.util.pd_available, getattr(wandb_run.Run._detect_and_apply_job_inputs, "only_where_staged", False)]
logger.finish()
print(json.dumps({"before": before, "while_opening": while_opening, "run": run.id, "lean": lean}))
"""


def test_a_logger_built_while_its_run_opens_leaves_w_and_b_to_the_opening_thread(tmp_path):
    """A run's logger is built while W&B's run opens on a thread of its own (``conf.wandb_run.WandbOpening``).
    Built then, it imports nothing of W&B: two threads importing W&B's modules at once failed 4 runs of 28
    of ``python train.py trainer.max_steps=1 tracker=off`` (``ImportError: cannot import name
    'load_yaml' from partially initialized module 'wandb.util'``). In a fresh interpreter, the opening
    thread held until the logger is built: no W&B module loaded meanwhile; then the run opens, made lean
    by the opening thread."""
    result = subprocess.run(
        [sys.executable, "-c", LOG_WHILE_IT_OPENS, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WANDB_SILENT": "true"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen == {"before": False, "while_opening": [], "run": "race0001", "lean": [False, True]}, seen
