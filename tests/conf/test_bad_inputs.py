"""Bad input to the real train.py: one line of error, a non-zero exit, and nothing created.

Each case runs train.py's own ``main`` with ``hydra.run.dir`` pointing at a directory that does not
exist yet (in this process: Hydra composing the command line, the run guard's checks, the one-line
report, all as ``python train.py`` runs them); after the refusal it must still not exist (Hydra
creates it, and writes ``.hydra/`` into it, before the task starts: the checks run in a Hydra
callback, before that), and no W&B run may have been started anywhere. A few cases run ``python
train.py`` itself in a subprocess, end to end.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import CodeRunningPayload, run_refused, run_train_process, train_env


def checkpoint_file(tmp_path, kind: str) -> str:
    path = tmp_path / f"{kind}.ckpt"
    torch.save({"global_step": 3, "state_dict": {"w": torch.ones(64, 64)}}, path)
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif kind == "foreign":
        torch.save({"weights": torch.ones(3)}, path)
    elif kind == "payload":
        torch.save({"global_step": 0, "state_dict": {}, "payload": CodeRunningPayload(tmp_path / "payload-ran")}, path)
    return str(path)


BAD_INPUTS = [
    # the command line itself (Hydra's checks against the typed schema)
    (["model.n_layer=3"], "n_layer"),  # a misspelt key
    (["model.n_layers=two"], "could not be converted to Integer"),
    (["model=transformer_xl"], "Could not find 'model/transformer_xl'"),
    (["model.normalization=batchnorm"], "expected one of"),
    (["data.name=shakespeare"], "the task is chosen by the data group"),
    (["data=shakespeare"], "Could not find 'data/shakespeare'"),
    (["data.n_triggers=3"], "n_triggers"),  # an option of another task
    (["logger.wandb.mode=sometimes"], "expected one of"),
    (["optim.betas=[0.9"], "no viable alternative"),
    # ranges and cross-field checks (conf/validate.py)
    (["model.n_layers=0"], "model.n_layers=0 must be >= 1"),
    (["model.d_head=128"], "model.d_head=128 must be <= d_model=64"),
    (["model.d_vocab=2"], "leaves 1 random tokens"),
    (["model.n_ctx=33", "data.seq_len=99"], "exceeds model.n_ctx"),
    (["data.batch_size=0"], "data.batch_size=0 must be >= 1"),
    (["data.n_min=9", "data.n_max=4"], "need 1 <= n_min <= n_max"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be >= 1"),
    (["trainer.checkpoint_every_n_steps=0"], "must be >= 1"),
    (["model.init=normal"], "model.init=normal needs init_std > 0 (got None)"),
    (
        ["data=sentence_gap_copy", "data.min_sentence=60"],
        "data.min_sentence=60, data.max_sentence=50, data.max_gap=50: need 1 <= min_sentence",
    ),
    (["model.init_std=0.02"], "model.init_std=0.02 goes with init=normal (init=fan_in)"),
    (["model.positions=sideways"], "expected one of"),
    (
        ["trajectory.budget_mb=0.1"],
        "trajectory.budget_mb=0.1: a budget of 0.1 MB holds fewer than the first and last step",
    ),
    (["trajectory.threshold=nan"], "trajectory.threshold=nan: need a finite number"),
    (["optim.lr=nan"], "optim.lr=nan: need a finite number"),
    (
        ["data=bigram_triggers", "optim.lr=inf", "data.concentration=-inf"],
        "optim.lr=inf, data.concentration=-inf: need a finite number",
    ),
    (["+trainer.max_step=10"], "unknown option trainer.max_step (not in the schema"),
    (["+tracker.ablation.evry_n_steps=10", "+seeed=3"], "unknown options seeed, tracker.ablation.evry_n_steps"),
    (["trajectory.trigger=sometimes"], "expected one of"),
    (["trainer.log_every_n_steps=0"], "must be >= 1"),
    (["trainer.accelerator=tpu"], "trainer.accelerator='tpu' must be one of"),
    (["trainer.precision=8-bit"], "trainer.precision='8-bit' must be one of"),
    (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1.0 must be > 0"),
    (["trainer=gpu"], "torch sees no GPU here (no CUDA device, no Apple MPS)"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["optim.weight_decay=-1"], "optim.weight_decay=-1.0 must be >= 0"),
    (["optim.warmup_steps=-10"], "optim.warmup_steps=-10 must be >= 0"),
    (["optim.betas=[0.9,1.5]"], "must be two numbers in [0, 1)"),
    (["logger.wandb.project="], "logger.wandb.project is empty"),
    (["tracker.every_n_steps=0"], "tracker.every_n_steps=0 must be >= 1"),
    (["tracker.ablation.every_n_steps=15"], "must be a multiple of"),
    (["tracker.measures=[nope]"], "tracker.measures has unknown ['nope']"),
    (["tracker.share.rows=first"], "tracker.share.rows='first' must be one of ('all', 'repeated', 'induction')"),
    (["tracker.share.centre=tokens"], "tracker.share.centre='tokens' must be one of ('sequences', 'none')"),
    (["tracker.share.floor=-1"], "tracker.share.floor=-1.0 must be a finite number >= 0"),
    (["tracker.probe_n=1"], "tracker.probe_n=1 must be >= 2"),
    (["tracker.probe_positions=0"], "tracker.probe_positions=0 must be >= 1"),
    (["tracker.smoothing_window=0"], "tracker.smoothing_window=0 must be >= 1"),
    (["tracker.chunk_mb=0"], "tracker.chunk_mb=0 must be >= 1"),
    # interventions during training
    (["intervention=ablate", "intervention.heads=[L5H9]"], "head 'L5H9' does not exist: the model has layers L0-L1"),
    (["intervention=ablate", "intervention.heads=[head1]"], "head 'head1': write L<layer>H<head>"),
    (["intervention=ablate", "intervention.heads=[]"], "name its heads"),
    (["intervention.heads=[L0H0]"], "intervention.heads=['L0H0'] is set but no intervention is chosen"),
    (["intervention=optogenetics"], "Could not find 'intervention/optogenetics'"),
    (["intervention.kind=lesion"], "expected one of"),
    (["intervention=clamp_prev_token", "intervention.target=next_token"], "expected one of"),
    (["intervention=clamp_prev_token", "intervention.strength=1.5"], "strength=1.5 must be in [0, 1]"),
    (["intervention=clamp_prev_token", "intervention.strength=-0.1"], "strength=-0.1 must be in [0, 1]"),
    (
        ["intervention=ablate", "intervention.from_step=600", "intervention.until_step=100"],
        "from_step=600 > until_step=100",
    ),
    (["intervention=ablate", "intervention.from_step=5000"], "from_step=5000 is not before trainer.max_steps=1500"),
    (["intervention=graft", "intervention.heads=[L0H1]"], "name the run to graft from"),
    (
        ["intervention=graft", "intervention.heads=[L0H1]", "intervention.source={notrun}"],
        "has no trajectory/index.json",
    ),
    (
        [
            "intervention=graft",
            "intervention.heads=[L0H1]",
            "intervention.source={source}",
            "intervention.source_step=7",
        ],
        "step 7 was not saved in",
    ),
    (
        ["intervention=graft", "intervention.heads=[L0H1]", "intervention.source={source}", "model.d_head=8"],
        "its model has d_head=16, this one 8: the weights do not fit",
    ),
    (
        ["intervention=graft", "intervention.heads=[L0H3]", "intervention.source={source}", "model.n_heads=4"],
        "its model has no head L0H3",
    ),
    # checkpoints to resume from
    (["resume=/nonexistent/last.ckpt"], "no such checkpoint file or run directory"),
    (["resume={empty}"], "the file is empty"),
    (["resume={truncated}"], "not a loadable checkpoint"),
    (["resume={foreign}"], "not a checkpoint of this project"),
    (["resume={payload}"], "not a loadable checkpoint"),
]


def graft_source(tmp_path, kind: str) -> str:
    """A run directory whose trajectory holds step 40 of the default model (``source``), or none (``notrun``)."""
    from models.transformer import AttentionOnlyTransformer, TransformerShape
    from records.trajectory import TrajectoryWriter

    path = tmp_path / kind
    path.mkdir(exist_ok=True)
    if kind == "source":
        shape = TransformerShape(n_layers=2, n_heads=2, d_model=64, d_head=16, n_ctx=33, d_vocab=257)
        TrajectoryWriter(path / "trajectory", shape, {}).add(40, AttentionOnlyTransformer(shape).state_dict(), ["test"])
    return str(path)


def with_checkpoints(overrides: list[str], tmp_path) -> list[str]:
    files = {"empty", "truncated", "foreign", "payload"}
    return [
        o.format(
            **{
                k: checkpoint_file(tmp_path, k) if k in files else graft_source(tmp_path, k)
                for k in (*files, "source", "notrun")
                if f"{{{k}}}" in o
            }
        )
        for o in overrides
    ]


def assert_refused_in_one_line(code: int, stderr: str, message: str, tmp_path) -> None:
    assert code != 0
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert message in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # no run directory, no .hydra/, no W&B run
    assert not list(tmp_path.rglob("wandb"))
    assert not (tmp_path / "payload-ran").exists()  # a crafted checkpoint's code never ran


@pytest.mark.parametrize("overrides, message", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_is_one_line_before_anything_is_created(tmp_path, overrides, message):
    result = run_refused(with_checkpoints(overrides, tmp_path), tmp_path / "run")
    assert_refused_in_one_line(result.returncode, result.stderr, message, tmp_path)


END_TO_END = [BAD_INPUTS[0], BAD_INPUTS[10], BAD_INPUTS[-1]]  # Hydra's check, the run guard's, a crafted checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", END_TO_END, ids=[" ".join(o) for o, _ in END_TO_END])
def test_python_train_py_refuses_bad_input_in_one_line_before_anything_is_created(tmp_path, overrides, message):
    result = run_train_process(with_checkpoints(overrides, tmp_path), tmp_path / "run", timeout=120)
    assert_refused_in_one_line(result.returncode, result.stderr, message, tmp_path)


@pytest.mark.slow
def test_bad_input_is_told_before_lightning_is_imported(tmp_path):
    """A config error costs its user the start-up of Python, Hydra and torch, not also Lightning's (3.5 s
    more on a 2-core machine, measured): nothing on the way to the config's check imports Lightning."""
    env = train_env(PYTHONPROFILEIMPORTTIME="1")  # Python's own import log, one stderr line a module
    result = run_train_process(["model.d_head=128"], tmp_path / "run", timeout=120, env=env)
    imported = {
        line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert result.returncode == 1 and "model.d_head=128 must be <= d_model=64" in result.stderr
    assert "torch" in imported and not {m for m in imported if m.split(".")[0] == "lightning"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.batch_sise=16"],
            "Key 'batch_sise' not in 'Repeated' (key data.batch_sise) (did you mean data.batch_size?)",
        ),
        (
            ["-m", "data.batch_sise=16,32", "seed=0,1"],
            "Could not override 'data.batch_sise': the config has no such key (did you mean data.batch_size?)",
        ),
        (["-m", "tracker.every_n_step=20", "seed=0,1"], "(did you mean tracker.every_n_steps?)"),
        (["-m", "model.qqq=1,2"], "Could not override 'model.qqq': the config has no such key"),
    ],
)
def test_a_misspelt_key_is_one_line_with_the_closest_key_and_a_sweep_leaves_nothing_behind(
    tmp_path, overrides, message
):
    result = run_refused(overrides, tmp_path / "run")
    assert_refused_in_one_line(result.returncode, result.stderr, message, tmp_path)
    assert "did you mean" not in result.stderr or message.endswith("?)")


@pytest.mark.slow
def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    result = run_train_process(["trainer.max_steps=2"], tmp_path / "a_file" / "run", timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "cannot make the run directory" in lines[0] and "Not a directory" in lines[0], lines[0]
    assert (tmp_path / "a_file").read_text() == "not a directory"


def test_a_launcher_of_an_extra_not_installed_names_its_install_command():
    """Hydra's one-line refusal of ``hydra/launcher=joblib`` where the ``sweeps`` extra is not installed
    (its exact words, as a core install prints them) gains the install command; a misspelt launcher,
    which no extra provides, does not."""
    from runtime.console import with_install_hint

    missing = "In 'hydra/config': Could not find 'hydra/launcher/joblib' Available options in 'hydra/launcher': basic, ensemble"
    assert with_install_hint(missing) == f"{missing}; joblib comes with the 'sweeps' extra: pip install -e '.[sweeps]'"
    optuna = "In 'hydra/config': Could not find 'hydra/sweeper/optuna' Available options in 'hydra/sweeper': basic"
    assert with_install_hint(optuna).endswith("optuna comes with the 'sweeps' extra: pip install -e '.[sweeps]'")
    typo = missing.replace("joblib", "joblb")
    assert with_install_hint(typo) == typo
