"""Every experiment preset in conf/experiment/ composes to a valid config, and trains a few steps
with the real train.py when shrunk (its model, batch and schedules; everything else as the preset)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from conf.schema import register_schemas
from conf.validate import config_problems
from tests.helpers import REPO, run_train

register_schemas()
PRESETS = sorted(path.stem for path in (REPO / "conf" / "experiment").glob("*.yaml"))
SHRUNK = [
    "trainer.max_steps=4",
    "data.batch_size=4",
    "model.n_heads=2",
    "model.d_model=32",
    "model.d_head=8",
    "tracker.every_n_steps=2",
    "tracker.ablation.every_n_steps=2",
    "tracker.all_measures.every_n_steps=2",
    "tracker.whitening.every_n_steps=2",
    "tracker.copying.every_n_steps=2",
    "tracker.matching.every_n_steps=2",
    "tracker.images.every_n_steps=0",
    "tracker.baseline_samples=50",
    "trajectory.every_n_steps=2",
    "trajectory.log_steps=2",
    "logger=csv",
]


def test_every_preset_is_listed():
    assert {"phase_change", "one_layer", "elhage_2l", "seed002", "seed002_cpu", "smallest_cliff"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_composes_to_a_valid_config(preset):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"])
    assert config_problems(cfg) == []


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_a_shrunk_preset_trains_a_few_steps(preset, tmp_path):
    result = run_train([f"experiment={preset}", *SHRUNK], tmp_path / "run", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "finished"
    assert (tmp_path / "run" / "phase_change.png").is_file()
