"""Bad configs fail before training with a clear message and a non-zero exit; the real config composes."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conf.schema import register_schemas
from conf.validate import config_changes, config_problems, llc_calibration_warning
from tests.helpers import CodeRunningPayload, composed

register_schemas()


def test_default_config_is_valid_and_matches_the_experiment():
    cfg = composed()
    assert config_problems(cfg) == []
    assert cfg.model.n_layers == 2 and cfg.tracker.every_n_steps == 10
    assert composed("experiment=one_layer").model.n_layers == 1


def test_a_paper_size_model_is_valid_with_its_trajectory_unless_a_budget_too_small_is_set():
    paper = ("model.n_layers=12", "model.n_heads=12", "model.d_model=768", "model.d_head=64")
    assert config_problems(composed(*paper)) == []
    (problem,) = config_problems(composed(*paper, "trajectory.budget_mb=40"))
    assert problem.startswith("trajectory.budget_mb=40.0: a budget of 40 MB holds fewer than the first and last step")


def test_llc_settings_at_a_size_they_were_not_calibrated_on_are_one_warning_line():
    assert llc_calibration_warning(composed()) is None
    assert llc_calibration_warning(composed("experiment=elhage_2l")) is None  # its own calibration
    assert llc_calibration_warning(composed("model.n_heads=4")) == (
        "warning: stages.llc's lr=0.001 and localization=100 were calibrated on a 2×2×64×16 model"
        " (layers×heads×d_model×d_head), this one is 2×4×64×16: check them with python -m analysis.calibrate_llc RUN_DIR"
    )


def test_multirun_with_several_devices_is_refused():
    problems = config_problems(composed("trainer.devices=2"), multirun=True)
    assert any("multirun" in p for p in problems)
    assert not any("multirun" in p for p in config_problems(composed("trainer.devices=2")))


@pytest.mark.parametrize(
    "overrides, n_ctx, probe_tokens, repeat",
    [
        ([], 33, 33, (8, 16)),  # the defaults: as before
        (["data.seq_len=65"], 65, 33, (8, 16)),  # a longer context holds more repeats of the same blocks
        (["data.seq_len=65", "data.block=half_context"], 65, 65, (16, 32)),  # the block grows with it
        (["data.seq_len=17", "data.n_min=4", "data.n_max=8"], 17, 17, (4, 8)),
        (["data.seq_len=65", "tracker.probe_n=10"], 65, 21, (8, 16)),  # a probe set by hand stays so
    ],
)
def test_the_models_context_the_probe_and_the_repeat_distance_follow_the_tasks_length(
    overrides, n_ctx, probe_tokens, repeat
):
    from conf.objects import build_probe, task_of

    cfg = composed(*overrides)
    assert config_problems(cfg) == []
    assert cfg.model.n_ctx == n_ctx and build_probe(cfg).tokens.shape[-1] == probe_tokens
    task = task_of(cfg)
    assert (task.n_min, task.n_max) == repeat
    ids = torch.arange(64)
    tokens = task.sampler(cfg.model.d_vocab - 1)(ids)
    assert tokens.shape == (64, n_ctx)


@pytest.mark.parametrize(
    "overrides, sequences, length",
    [
        ([], 16, 33),  # probe_batch_size's 16 where probe_positions is unset
        (["experiment=emergence"], 64, 33),  # 1024 positions: 64 blocks of 16
        (["experiment=emergence", "data.seq_len=257", "data.block=half_context"], 8, 257),  # 8 of 128
        (["experiment=emergence", "data.seq_len=257", "data.block=fixed"], 64, 33),  # the blocks stay 8-16
        (["tracker.probe_positions=20", "tracker.probe_n=6"], 4, 13),  # ceil(20 / 6)
    ],
)
def test_probe_positions_sets_as_many_sequences_as_hold_that_many_repeated_positions(overrides, sequences, length):
    from conf.objects import build_probe

    cfg = composed(*overrides)
    assert config_problems(cfg) == []
    assert tuple(build_probe(cfg).tokens.shape) == (sequences, length)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.n_ctx=33", "data.seq_len=40"], "exceeds model.n_ctx"),
        (["data.block=doubled"], "data.block='doubled': must be one of fixed, half_context"),
        (["model.d_head=100"], "d_head"),
        (["data.n_min=9", "data.n_max=4"], "n_min <= n_max"),
        (["data.name=bigram_triggers"], "the task is chosen by the data group, data=NAME (data=repeated here)"),
        (["tracker.probe_n=20"], "probe"),
        (["tracker.measures=[frobenius,nope]"], "unknown ['nope']"),
        (["trainer.max_steps=0"], "max_steps"),
        (["model.d_vocab=2"], "random tokens"),
        (["logger.csv=false"], "needs logger.csv=true"),
        (["trainer.log_every_n_steps=0"], "log_every_n_steps"),
        (["trainer.precision=fp8"], "precision"),
        (["tracker.ablation.every_n_steps=15"], "ablation.every_n_steps=15 must be a multiple"),
        (["tracker.ablation.every_n_steps=-1"], "ablation.every_n_steps=-1 must be >= 0"),
        (["tracker.writes.every_n_steps=7"], "writes.every_n_steps=7 must be a multiple"),
        (["tracker.whitening.every_n_steps=-5"], "must be >= 0 (0 at every snapshot)"),
        (
            ["tracker.all_measures.every_n_steps=15"],
            "all_measures.every_n_steps=15 must be a multiple of tracker.every_n_steps=10",
        ),
        (["tracker.all_measures.every_n_steps=-1"], "all_measures.every_n_steps=-1 must be >= 0 (0 at every snapshot)"),
        (["tracker.every_n_steps=30"], "all_measures.every_n_steps=100 must be a multiple of tracker.every_n_steps=30"),
        (["tracker.dense_measures=[frobenius,nope]"], "tracker.dense_measures has unknown ['nope']"),
        (["tracker.num_threads=0"], "num_threads=0"),
        (["tracker.chunk_mb=0"], "chunk_mb=0"),
        (["optim.weight_decay=-1"], "weight_decay=-1"),
        (["trainer.gradient_clip_val=-1"], "gradient_clip_val=-1"),
        (["optim.warmup_steps=-10"], "warmup_steps=-10"),
        (["tracker.smoothing_window=0"], "smoothing_window=0"),
        (["logger.wandb.project="], "project is empty"),
        (["optim.betas=[0.9]"], "betas"),
        (["tracker.measures=[]"], "empty"),
        (["tracker.images.every_n_steps=25"], "multiple of"),
        (["resume=/nonexistent/last.ckpt"], "no such checkpoint"),
    ],
)
def test_cross_field_problems_are_named(overrides, message):
    problems = config_problems(composed(*overrides))
    assert any(message in p for p in problems), problems


def test_a_checkpoint_carrying_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "payload-ran"
    checkpoint = tmp_path / "crafted.ckpt"
    torch.save({"global_step": 0, "state_dict": {}, "payload": CodeRunningPayload(marker)}, checkpoint)
    problems = config_problems(composed(f"resume={checkpoint}"))
    assert any("not a loadable checkpoint" in p for p in problems), problems
    assert not marker.exists()  # the payload never ran


@pytest.mark.parametrize("damage", ["empty", "truncated", "foreign"])
def test_a_damaged_checkpoint_is_one_clear_error(tmp_path, damage):
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"global_step": 3, "state_dict": {"w": torch.ones(64, 64)}}, checkpoint)
    if damage == "empty":
        checkpoint.write_bytes(b"")
    elif damage == "truncated":
        checkpoint.write_bytes(checkpoint.read_bytes()[:200])
    else:
        torch.save({"weights": torch.ones(3)}, checkpoint)  # loads, but is no checkpoint of ours
    problems = [p for p in config_problems(composed(f"resume={checkpoint}")) if p.startswith("resume=")]
    assert len(problems) == 1 and "\n" not in problems[0], problems
    expected = {
        "empty": "is empty",
        "truncated": "not a loadable checkpoint",
        "foreign": "not a checkpoint of this project",
    }[damage]
    assert expected in problems[0]


@pytest.mark.parametrize(
    "overrides, key",
    [(["data.min_sentence=2"], "min_sentence"), (["data=sentence_gap_copy", "data.n_max=20"], "n_max")],
)
def test_an_option_of_another_task_is_not_an_option_of_this_one(overrides, key):
    """Each task has its own options: one of another task's is refused as Hydra refuses any unknown key."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=key):
        composed(*overrides)


def test_data_seed_follows_the_run_seed_unless_set():
    assert composed("seed=3").data.seed == 3
    assert composed("seed=3", "data.seed=7").data.seed == 7


def test_a_run_made_before_an_option_existed_resumes_unchanged():
    """A checkpoint's config from before ``model.positions``, ``model.biases`` and ``model.init``
    existed reads them as their defaults: no change; a changed one is still named."""
    now = OmegaConf.to_container(composed(), resolve=True, enum_to_str=True)
    old = OmegaConf.to_container(composed(), resolve=True, enum_to_str=True)
    for key in ("positions", "biases", "init"):
        del old["model"][key]
    assert config_changes(old, now) == []
    changed = OmegaConf.to_container(composed("model.biases=true"), resolve=True, enum_to_str=True)
    assert config_changes(old, changed) == ["model.biases: False -> True"]


def test_seed_002s_presets_are_its_library_s_model_and_the_others_documented_overrides():
    """experiment=aslvrstn_2022 is the study's matching variant (docs/results.md, "Seed 002's run"):
    shortformer positions and biases, init N(0, 0.02²), no norm; aslvrstn_2022_cpu changes only the batch,
    the vocabulary and the steps; the study's other variants compose as overrides."""
    cfg = composed("experiment=aslvrstn_2022")
    assert config_problems(cfg) == []
    assert (cfg.model.positions, cfg.model.biases, cfg.model.normalization) == ("shortformer", True, "none")
    assert (cfg.model.init, cfg.model.init_std, cfg.data.batch_size, cfg.model.d_vocab) == ("normal", 0.02, 1000, 1000)
    laptop = composed("experiment=aslvrstn_2022_cpu")
    assert (laptop.data.batch_size, laptop.model.d_vocab, laptop.trainer.max_steps) == (100, 100, 4000)
    exact = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert sorted(config_changes(exact, OmegaConf.to_container(laptop, resolve=True, enum_to_str=True))) == [
        "data.batch_size: 1000 -> 100",
        "model.d_vocab: 1000 -> 100",
    ]  # what trains differently (the steps and tags are not compared)
    for variant in (
        ["model.positions=standard", "model.biases=false"],  # the preset before the study
        ["model.normalization=layernorm"],
        ["model.init=gpt2", "model.init_std=null"],
        ["data.min_sentence=2", "data.max_sentence=51"],  # the script's copy lengths
    ):
        assert config_problems(composed("experiment=aslvrstn_2022", *variant)) == []


def test_the_models_option_defaults_are_the_schemas():
    """TransformerShape keeps defaults for its options only (a saved shape older than an option
    loads as the plain model); they must be the schema's, the one source of defaults."""
    import dataclasses

    from omegaconf import OmegaConf

    from conf.schema import ModelConfig
    from models.transformer import TransformerShape

    schema = OmegaConf.to_container(OmegaConf.structured(ModelConfig), enum_to_str=True)
    with_default = {
        f.name: f.default for f in dataclasses.fields(TransformerShape) if f.default is not dataclasses.MISSING
    }
    assert set(with_default) == {"normalization", "positions", "biases"}
    assert with_default == {name: schema[name] for name in with_default}


@pytest.mark.parametrize("value", ["", "sometimes"])
def test_a_wandb_mode_in_the_environment_that_wandb_refuses_is_one_line_before_any_work(monkeypatch, value):
    """``export WANDB_MODE=$MODE`` with MODE unset leaves it empty: W&B raised a 43-line traceback
    from inside the run, after its directory existed."""
    monkeypatch.setenv("WANDB_MODE", value)
    problems = config_problems(composed())
    assert problems == [
        f"WANDB_MODE={value!r} in the environment is not a W&B mode: unset it, or set it to offline, online or"
        " disabled (W&B reads it whatever logger.wandb.mode says)"
    ]
    assert config_problems(composed("logger=csv")) == []  # no W&B run: nothing reads it
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert config_problems(composed()) == []


def test_wandb_mode_precedence(monkeypatch):
    from omegaconf import OmegaConf

    from conf.schema import LoggerConfig, WandbMode
    from records.wandb_run import wandb_mode

    cfg = OmegaConf.create({"logger": OmegaConf.structured(LoggerConfig)})
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(cfg) == "offline"  # no account, no network needed by default
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode(cfg) == "online"
    cfg.logger.wandb.mode = WandbMode.disabled  # an explicit override wins over the environment
    assert wandb_mode(cfg) == "disabled"
