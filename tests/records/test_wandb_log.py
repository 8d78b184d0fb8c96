"""W&B's sections: every tracker key lands in one, the story fits a page, and the prefix undoes; a run's
W&B run opens on one thread while the run is built, and W&B is left as it is (nothing of it replaced)."""

from __future__ import annotations

import json
import subprocess
import sys

from records.wandb_sections import SECTION_NAMES, section_of, story, summary_of, tracker_key, wandb_key
from tests.helpers import REPO, fake_snapshot, snapshot_keys


def test_every_tracker_key_has_a_section_and_round_trips():
    for shape in ((2, 2), (4, 8), (12, 12)):  # per-pair mode, and summary mode with and without per-head keys
        keys = snapshot_keys(fake_snapshot(*shape))
        assert all(section_of(key) is not None for key in keys), [k for k in keys if section_of(k) is None]
        assert all(tracker_key(wandb_key(key)) == key for key in keys)
        missing = [e for e in story() if not any(k == e or (e.endswith("/") and k.startswith(e)) for k in keys)]
        assert missing == ["heads/statistical_induction/top"]  # the story is there in either mode (chains': not here)


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
    # nine keys a run shows and the strategies' kl/, closest, weight/: the story names both prefix-matching
    # scores (induction on repeated tokens, statistical induction on chains), of which a run logs one
    told = story() - {"heads/statistical_induction/top"}
    assert list(SECTION_NAMES) == sorted(SECTION_NAMES) and len(told) <= 12


def test_summaries_keep_the_best_value_in_the_right_direction():
    assert summary_of("loss/repeated") == summary_of("loss/icl_score") == "min,last"
    assert summary_of("circuit/K/frobenius_minus_baseline_rank") == "min,last"
    assert summary_of("heads/induction/top") == summary_of("circuit/ablation/loss_change") == "max,last"
    assert summary_of("comp/K/frobenius/L0H1->L1H0") is None


BUILT_WHILE_IT_OPENS = """
import json
import sys
import threading

from omegaconf import OmegaConf

from records.wandb_run import WandbOpening
from runtime.build import build_loggers, build_callbacks
from runtime.continuation import Continuation
from tests.helpers import composed

released = threading.Event()


class HeldOpening(WandbOpening):
    def _open(self):  # the opening thread, held until the run's callbacks are built
        released.wait()
        super()._open()


before = "wandb" in sys.modules
cfg = composed("trainer.max_steps=2")
opening = HeldOpening(dict(project="race", name="race", id="race0001", dir=sys.argv[1], mode="offline"))
callbacks = build_callbacks(cfg, __import__("pathlib").Path(sys.argv[1]), "race0001")
while_opening = sorted(m for m in sys.modules if m == "wandb" or m.startswith("wandb."))
released.set()
(logger, *_) = build_loggers(cfg, __import__("pathlib").Path(sys.argv[1]), Continuation(), "race0001", opening=opening)
import lightning_utilities.core.imports as lightning_asks
import wandb.util
from wandb.sdk import wandb_run


OURS = {"analysis", "callbacks", "conf", "data", "metrics", "models", "records", "reports", "runtime", "train"}


def replaced(namespace):  # the names of namespace that this project's code defines: what a patch leaves
    return [name for name, v in vars(namespace).items() if str(getattr(v, "__module__", "")).split(".")[0] in OURS]


foreign = replaced(wandb.util) + replaced(wandb_run.Run) + replaced(lightning_asks)
flags = {name: v for name, v in vars(wandb.util).items() if isinstance(v, bool)}
logger.finish()
print(json.dumps({"before": before, "while_opening": while_opening, "run": logger.experiment.id, "foreign": foreign, "flags": flags}))
"""


def test_a_runs_wandb_run_opens_on_its_own_thread_and_wandb_is_left_as_shipped(tmp_path):
    """A run's W&B run opens on a thread of its own (``records.wandb_run.WandbOpening``) while the run's
    callbacks are built; until it is open no other thread imports W&B (two threads importing W&B's
    modules at once failed 4 runs of 28 of ``python train.py trainer.max_steps=1 tracker=off``:
    ``ImportError: cannot import name 'load_yaml' from partially initialized module 'wandb.util'``). In a
    fresh interpreter, the opening thread held until the callbacks are built: no W&B module loaded
    meanwhile; then the logger takes the open run. W&B's and Lightning's own functions are the ones they
    ship (nothing replaced to save start-up time)."""
    result = subprocess.run(
        [sys.executable, "-c", BUILT_WHILE_IT_OPENS, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WANDB_SILENT": "true", "WANDB_MODE": "offline"},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    fresh = subprocess.run([sys.executable, "-c", FLAGS_AS_SHIPPED], capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    shipped = json.loads(fresh.stdout.splitlines()[-1])
    assert seen == {"before": False, "while_opening": [], "run": "race0001", "foreign": [], "flags": shipped}, seen


FLAGS_AS_SHIPPED = """
import json
import wandb.util
print(json.dumps({name: v for name, v in vars(wandb.util).items() if isinstance(v, bool)}))
"""
