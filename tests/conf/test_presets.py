"""Every experiment preset in conf/experiment/ composes to a valid config, and trains a few steps
with the real train.py when shrunk (its model, batch, probe and schedules; everything else as the preset)."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from conf.schema import register_schemas
from conf.validate import config_problems
from tests.helpers import REPO, run_train

register_schemas()

PRESETS = sorted(path.stem for path in (REPO / "conf" / "experiment").glob("*.yaml"))
"""Every preset of conf/experiment/."""
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
    "tracker.writes.every_n_steps=2",
    "tracker.matching.every_n_steps=2",
    "tracker.images.every_n_steps=0",
    "tracker.baseline_samples=50",
    "tracker.probe_batch_size=8",  # the probe too: its random nulls, computed once a machine, scale with it
    "tracker.probe_positions=null",
    "trajectory.every_n_steps=2",
    "trajectory.log_steps=2",
    "logger=csv",
]


def test_every_preset_is_listed():
    assert {"phase_change", "one_layer", "elhage_2l", "aslvrstn_2022", "aslvrstn_2022_cpu", "smallest_cliff"} <= set(
        PRESETS
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_composes_to_a_valid_config(preset):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"])
    assert config_problems(cfg) == []


@pytest.fixture(scope="module")
def shrunk_sweep(tmp_path_factory):
    """Every preset, shrunk, as one ``python train.py -m experiment=...`` (job ``i`` is ``PRESETS[i]``):
    in this process, a failing job marked failed while the others go on."""
    sweep_dir = tmp_path_factory.mktemp("presets")
    return sweep_dir, run_train(["-m", f"experiment={','.join(PRESETS)}", *SHRUNK], sweep_dir)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_a_shrunk_preset_trains_a_few_steps(preset, shrunk_sweep):
    sweep_dir, result = shrunk_sweep
    run_dir = sweep_dir / str(PRESETS.index(preset))
    assert (run_dir / "status.json").is_file(), result.stderr[-3000:]
    assert f"experiment={preset}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "finished", (status, result.stderr[-3000:])
    assert json.loads((run_dir / "summary.json").read_text())["final/loss/repeated"] > 0  # its report, without figures


def preset_base(preset: str) -> tuple[dict, list[str]]:
    """The keys ``preset`` sets (flat, its defaults list and Hydra's settings aside), and the overrides
    that compose everything *but* them: its parent preset, or none, and its group choices."""
    from omegaconf import OmegaConf

    from records.keys import flatten

    text = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "experiment" / f"{preset}.yaml"))
    base = ["~experiment"]
    for entry in text.pop("defaults", []):
        if isinstance(entry, str):
            base = [f"experiment={entry}"]  # a preset built on another
        else:
            ((key, value),) = entry.items()
            group = key.removeprefix("override /")
            if not group.startswith("hydra"):
                base.append(f"{group}={value}")
    text.pop("hydra", None)
    return flatten(text), base


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_states_only_what_differs_from_the_schema_and_its_parent(preset):
    from omegaconf import OmegaConf

    from tests.helpers import composed

    keys, base = preset_base(preset)
    ours, theirs = composed(f"experiment={preset}"), composed(*base)
    value = lambda cfg, key: OmegaConf.to_container(OmegaConf.create({"v": OmegaConf.select(cfg, key)}), resolve=True)
    restated = [f"{key}={value(ours, key)['v']}" for key in keys if value(ours, key) == value(theirs, key)]
    assert not restated, f"conf/experiment/{preset}.yaml restates: {restated}"


def test_the_emergence_grid_is_one_the_law_can_be_read_from():
    """experiment=emergence (docs/emergence.md): at least 4 values of the batch size and the context, the
    largest at least 7x the smallest, both meanings of the context, 3 seeds a cell, trained as ensembles
    two at a time; the measures that do not time the phase change at a period, not at every snapshot."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=emergence"], return_hydra_config=True)
    params = {key: str(value).split(",") for key, value in cfg.hydra.sweeper.params.items()}
    for variable in ("data.batch_size", "data.seq_len"):
        values = sorted(map(int, params[variable]))
        assert len(values) >= 4 and values[-1] >= 7 * values[0], (variable, values)
    assert sorted(params["data.block"]) == ["fixed", "half_context"] and len(params["seed"]) >= 3
    assert cfg.hydra.launcher._target_.endswith("EnsembleLauncher") and cfg.hydra.launcher.n_jobs == 2
    assert list(cfg.hydra.launcher.split_by) == ["data.block"]  # the meanings stop at different steps
    tracker = cfg.tracker
    assert tracker.stop_after_phase_change and tracker.probe_positions == 1024
    for part in ("all_measures", "whitening"):  # 0 would mean every snapshot
        assert tracker[part].every_n_steps > tracker.every_n_steps
    for launcher in ("submitit_slurm", "joblib", "basic"):  # another launcher replaces its options whole
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            other = compose(
                "config", overrides=["experiment=emergence", f"hydra/launcher={launcher}"], return_hydra_config=True
            )
        assert "split_by" not in other.hydra.launcher
