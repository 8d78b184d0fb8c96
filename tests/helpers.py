"""What the tests share: a hand-built induction circuit, small models, the real train.py in a
process of its own (started warm: tests/warm_start.py) or in this one, readers of W&B histories, SLURM
helpers. Test modules import from here, never from each other."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from data.datamodule import TokenDataModule
from data.probe import ProbeBatch
from data.tasks.repeated import Repeated
from metrics.composition.baseline import Baseline
from metrics.composition.data_shares import SHARE, DataShares
from metrics.composition.measures import WEIGHT_MEASURES
from metrics.ground_truth.ablation import KeyAblation
from metrics.ground_truth.validity import Agreement
from metrics.heads.circuit_scores import MATCHING
from metrics.snapshot import Snapshot
from metrics.tracked.composition import CompositionOptions, CompositionScores
from metrics.tracked.ground_truth import AblationResult
from metrics.tracked.probe_views import LossViewValues
from models.lit_module import InductionLM
from models.optimizer import OptimizerSettings
from models.transformer import AttentionOnlyTransformer, TransformerShape
from records import wandb_records
from records.wandb_run import PAGE_KEY

REPO = Path(__file__).resolve().parents[1]


def require_extra(module: str, extra: str):
    """``module`` of an optional extra, imported, for a test that checks against it (devinterp, TransformerLens,
    the sweep plugins). Where it does not import, the test skips, naming the extra that installs it; under
    ``REQUIRE_EXTRAS`` (CI: ``make test`` installs every extra) it fails instead, as the browser and SLURM
    tests do under ``REQUIRE_BROWSER`` and ``REQUIRE_SLURM``. Callable at a test module's top level."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        reason = f"{module} does not import ({error}): pip install -e '.[{extra}]' (make test installs every extra)"
        if os.environ.get("REQUIRE_EXTRAS"):
            pytest.fail(f"REQUIRE_EXTRAS is set but {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


MEASURES = tuple(CompositionOptions().measures)  # the measures a run tracks by default


# --- a hand-built induction circuit ------------------------------------------------------------


# A two-layer model whose weights implement an induction circuit by hand.
#
# Residual stream blocks (``V = d_vocab`` dims each, plus ``n_ctx`` for positions):
# ``TOKEN`` (the token's one-hot), ``POS`` (position one-hot), ``PREV`` (previous token, written by
# L0H0), ``OUT`` (the induction head's prediction, read by the unembedding).
#
# - L0H0, previous-token head: queries read position p, keys position p - 1; copies TOKEN -> PREV.
# - L1H0, induction head: queries read TOKEN, keys read PREV (K-composition with L0H0);
#   copies TOKEN -> OUT.
# - L0H1 and L1H1: small random distractors.
SHARP = 30.0  # attention logit scale: makes the hand-built patterns nearly one-hot


def induction_circuit_model(d_vocab: int = 9, n_ctx: int = 9, seed: int = 0) -> AttentionOnlyTransformer:
    V, P = d_vocab, n_ctx
    d_model, d_head = 3 * V + P, max(V, P)
    TOKEN, POS, PREV, OUT = 0, V, V + P, 2 * V + P
    model = AttentionOnlyTransformer(
        TransformerShape(n_layers=2, n_heads=2, d_model=d_model + V, d_head=d_head, n_ctx=P, d_vocab=V)
    )
    d_model += V  # the OUT block
    generator = torch.Generator().manual_seed(seed)
    eye = lambda n: torch.eye(n)
    scale = SHARP * d_head**0.5
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.W_E[:, TOKEN : TOKEN + V] = eye(V)
        model.W_pos[:, POS : POS + P] = eye(P)
        prev, ind = model.layers[0], model.layers[1]
        # L0H0: query at p matches key at p - 1
        prev.W_Q[0, POS : POS + P, :P] = scale * eye(P)
        prev.W_K[0, POS : POS + P - 1, 1:P] = eye(P - 1)
        prev.W_V[0, TOKEN : TOKEN + V, :V] = eye(V)
        prev.W_O[0, :V, PREV : PREV + V] = eye(V)
        # L1H0: query's token matches key's previous token
        ind.W_Q[0, TOKEN : TOKEN + V, :V] = scale * eye(V)
        ind.W_K[0, PREV : PREV + V, :V] = eye(V)
        ind.W_V[0, TOKEN : TOKEN + V, :V] = eye(V)
        ind.W_O[0, :V, OUT : OUT + V] = eye(V)
        model.W_U[OUT : OUT + V, :] = 10.0 * eye(V)
        for layer in (prev, ind):
            for name in ("W_Q", "W_K", "W_V", "W_O"):
                w = getattr(layer, name)
                w[1] = 0.05 * torch.randn(w[1].shape, generator=generator)
    return model


# --- shared by several test modules ----------------------------------------------------------

TOKENS = torch.tensor([[8, 0, 1, 2, 3, 0, 1, 2, 3], [8, 5, 7, 6, 4, 5, 7, 6, 4], [8, 2, 6, 1, 7, 2, 6, 1, 7]])


PROBE = ProbeBatch(tokens=TOKENS, n=4, first_start=1)


def easytransformer_like(positions: str, biases: bool, normalization: str = "none") -> AttentionOnlyTransformer:
    """A small model with the options of seed 002's library, biases drawn away from their zero start."""
    torch.manual_seed(0)
    model = AttentionOnlyTransformer(
        TransformerShape(2, 2, 16, 4, 9, 11, normalization, positions, biases), "gpt2"
    ).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b_") or "norm" in name:
                parameter.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


# --- short in-process training runs ----------------------------------------------------------

SMALL = TransformerShape(n_layers=2, n_heads=2, d_model=32, d_head=8, n_ctx=17, d_vocab=21)
"""The shape the callback tests train in process: a few steps take well under a second."""


def quiet_trainer(callbacks: list, max_steps: int, logger=False, **options) -> L.Trainer:
    """A CPU Trainer with no progress bar or model summary, checkpointing off unless ``options``
    say otherwise (every other option goes to the Trainer as given)."""
    options.setdefault("enable_checkpointing", False)
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def fit_repeated(trainer: L.Trainer, warmup_steps: int, weight_decay: float = 0.0, ckpt_path=None) -> InductionLM:
    """Train a fresh :data:`SMALL` model with ``trainer`` on repeated blocks of 4-8 tokens (batch
    8, Adam at 3e-3), from ``ckpt_path`` if given; returns the module."""
    module = InductionLM(SMALL, OptimizerSettings(lr=3e-3, weight_decay=weight_decay, warmup_steps=warmup_steps))
    data = TokenDataModule(Repeated(seq_len=17, n_min=4, n_max=8).sampler(20), 8)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


ALL_MEASURES = tuple(WEIGHT_MEASURES)


def pair_tensor(n_layers: int, n_heads: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform [0, 1) ``[L, H, L, H]`` float64, NaN where the reader's layer is not later."""
    values = torch.rand(n_layers, n_heads, n_layers, n_heads, generator=generator, dtype=torch.float64)
    layer = torch.arange(n_layers)
    later = layer[None, None, :, None] > layer[:, None, None, None]
    return values.masked_fill(~later, float("nan"))


def fake_results(n_layers: int, n_heads: int, measures=None, seed: int = 0) -> dict:
    """Random results of every tracked quantity, as the quantities lay them out (a baseline for each
    weight-based measure; the data-aware share's parts when it is among ``measures``, the default
    measures by default); the ablation and validity too."""
    measures = tuple(MEASURES) if measures is None else tuple(measures)
    g = torch.Generator().manual_seed(seed)
    heads = lambda: torch.rand(n_layers, n_heads, generator=g, dtype=torch.float64)
    scores = {m: {kind: pair_tensor(n_layers, n_heads, g) for kind in "QKV"} for m in measures}
    parts = lambda: {kind: heads() for kind in "QKV"}
    extras = {SHARE: DataShares(scores[SHARE], parts(), parts(), parts())} if SHARE in measures else {}
    baselines = {
        m: Baseline(mean=0.1 + 0.01 * i, stderr=0.001, n_samples=100)
        for i, m in enumerate(measures)
        if m in WEIGHT_MEASURES
    }
    results = {
        "loss_views": LossViewValues(first_occurrence=5.0, repeated=2.0, icl_score=-1.0),
        "circuit": ((0, min(1, n_heads - 1)), (1, 0)) if n_layers > 1 else None,
        "composition": CompositionScores(scores, baselines, extras),
        "writes": fake_write_reading(n_layers, n_heads, g),
        "matching": pair_tensor(n_layers, n_heads, g),
        "strategies": fake_strategy_reading(g),
        "behaviour": fake_behaviour_reading(n_layers, n_heads, g),
        "ablation": AblationResult(
            KeyAblation(
                pattern_change=pair_tensor(n_layers, n_heads, g), loss_change=pair_tensor(n_layers, n_heads, g)
            ),
            "exact",
        ),
        "validity": {
            effect: {
                m: Agreement(2, 0.5, writer=Agreement(1, 1.0), reader=Agreement(1, 1.0)) for m in (*measures, MATCHING)
            }
            for effect in ("loss_change", "pattern_change")
        },
    }
    return results


def fake_behaviour_reading(n_layers: int, n_heads: int, g: torch.Generator):
    """A random reading of every head's behaviours on a batch of 4 sequences (the behaviour quantity's result)."""
    from metrics.heads.behaviour import BUILT_IN_BEHAVIOURS as BEHAVIOURS
    from metrics.heads.behaviour import Null, head_types
    from metrics.tracked.head_behaviour import BehaviourReading

    per_sequence = torch.rand(n_layers, 4, n_heads, len(BEHAVIOURS), generator=g, dtype=torch.float64)
    scores = per_sequence.mean(1)
    behaviours = tuple(name for name in BEHAVIOURS if name != "statistical_induction")
    null = Null(
        torch.full((len(BEHAVIOURS),), 0.1, dtype=torch.float64),
        torch.full((len(BEHAVIOURS),), 0.05, dtype=torch.float64),
    )
    types = head_types(scores, null, behaviours, names=BEHAVIOURS)
    return BehaviourReading(scores, per_sequence, types, behaviours, null, BEHAVIOURS)


def fake_write_reading(n_layers: int, n_heads: int, g: torch.Generator):
    """A random reading of what every head writes (the writes quantity's result)."""
    from metrics.heads.behaviour import Null
    from metrics.heads.behaviours.base import behaviours_reading
    from metrics.tracked.head_behaviour import WriteReading

    names = tuple(behaviours_reading("writes"))
    scores = torch.rand(n_layers, n_heads, len(names), generator=g, dtype=torch.float64)
    null = Null(torch.zeros(len(names), dtype=torch.float64), torch.full((len(names),), 0.1, dtype=torch.float64))
    return WriteReading(scores, names, null)


def fake_strategy_reading(g: torch.Generator):
    """A random reading of the repeated task's strategies (no truth), eight held-out sequences."""
    from metrics.tracked.strategies import StrategyReading

    names = ("uniform", "copy", "induction")
    kl = {name: torch.rand(8, generator=g, dtype=torch.float64).numpy() for name in names}
    weights = torch.rand(3, generator=g, dtype=torch.float64).numpy()
    return StrategyReading(names, kl, None, weights / weights.sum(), 0.01)


def fake_quantities(measures=None) -> dict:
    """Every tracked quantity with its default options, the composition tracking ``measures``."""
    from metrics.tracked.base import tracked_quantities
    from metrics.tracked.composition import Composition, CompositionOptions

    built = {name: cls() for name, cls in tracked_quantities().items()}
    if measures is not None:
        built["composition"] = Composition(CompositionOptions(measures=list(measures)))
    return built


def snapshot_of(results: dict, measures=None, step: int = 0) -> Snapshot:
    """The snapshot of ``results`` (a quantity's result None: not measured), with the outputs each
    quantity's own :meth:`outputs` makes of them."""
    from types import SimpleNamespace

    run = SimpleNamespace(circuit=results.get("circuit"), step=step, results=results)
    quantities = fake_quantities(measures)
    outputs = [
        output
        for name, quantity in quantities.items()
        if results.get(name) is not None
        for output in quantity.outputs(results[name], run)
    ]
    return Snapshot(results, outputs)


def fake_snapshot(n_layers: int, n_heads: int, measures=None, seed: int = 0, **overrides) -> Snapshot:
    """A snapshot of random results of every quantity (:func:`fake_results`); ``overrides`` replace
    results by quantity name (e.g. ``ablation=None``)."""
    return snapshot_of({**fake_results(n_layers, n_heads, measures, seed), **overrides}, measures)


def snapshot_keys(snap: Snapshot, measures=None, max_pair_keys: int = 300, top_pairs: int = 3, max_head_keys: int = 32):
    """``records.keys.snapshot_metrics`` of ``snap`` in the mode a tracker of the default quantities
    (tracking ``measures``) would log a model of its shape in."""
    from metrics.tracked.base import PerPair
    from records.keys import pair_key_count, snapshot_metrics

    shape = next((tuple(o.values.shape[:2]) for o in snap.outputs if isinstance(o, PerPair)), None)  # [L, H, L, H]
    keys_per_pair = sum(q.pair_keys for q in fake_quantities(measures).values())
    per_pair = shape is None or pair_key_count(*shape, keys_per_pair) <= max_pair_keys
    return snapshot_metrics(snap.outputs, snap.circuit, per_pair, top_pairs, max_head_keys)


def wandb_history(run_dir) -> list[dict]:
    """Every logged row of every W&B run file in the run directory, in start order, minus media
    references (their file names carry random ids and W&B's own step counter) and the explorer page's
    rows (a stopped run logs the page of the run so far, which an uninterrupted one has not); a chart's
    table is compared by its digest (``charts/.../sha256``)."""
    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        rows += [
            {
                k: v
                for k, v in row.items()
                if not k.startswith(("_", "images/", "validity/table")) and not k.endswith("path")
            }
            for row in wandb_records.history(path)
            if not any(k.startswith(f"{PAGE_KEY}/") for k in row)
        ]
    return rows


def hand_fold(norm, W):
    """A reading weight ``W [d_model, k]`` in float64 with the norm folded in by hand: ``diag(g) W``,
    then under LayerNorm its mean over d_model subtracted (the centring, TransformerLens-style)."""
    W = W.detach().double()
    gain = getattr(norm, "weight", None)
    W = W if gain is None else gain.detach().double()[:, None] * W
    return W - W.mean(0, keepdim=True) if isinstance(norm, torch.nn.LayerNorm) else W


def hand_centre(norm, W):
    """A writing weight ``W [..., d_model]`` in float64, under LayerNorm each row minus its mean over
    d_model (TransformerLens's ``center_writing_weights``, by hand)."""
    W = W.detach().double()
    return W - W.mean(-1, keepdim=True) if isinstance(norm, torch.nn.LayerNorm) else W


def dense_reader_factors(model, layer, head, kind):
    """The reader's (read factor, full matrix) for a composition kind, from the raw weights (the
    norm folded into the readers, ``W_O`` centred under LayerNorm, by hand)."""
    attn = model.layers[layer]
    W = {n: getattr(attn, n)[head].detach().double() for n in ("W_Q", "W_K", "W_V", "W_O")}
    Q, K, V = (hand_fold(attn.norm, W[n]) for n in ("W_Q", "W_K", "W_V"))
    return {"Q": (Q, Q @ K.T), "K": (K, K @ Q.T), "V": (V, V @ hand_centre(attn.norm, W["W_O"]))}[kind]


def slurm_is_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    result = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return result.returncode == 0 and any(state in result.stdout for state in ("idle", "mix", "alloc"))


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def job_field(job: str, field: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return next((word.split("=", 1)[1] for word in shown.split() if word.startswith(f"{field}=")), "")


def start_requeued_job_now(job: str) -> None:
    """Let a requeued job start now rather than after SLURM's two-minute hold, but not within the
    second of the requeue: slurmd revokes the first launch's credential with a one-second timestamp
    and refuses (the job then FAILS) a relaunch whose credential is as old."""
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)


# --- the real train.py, in a process of its own or in this one ----------------------------------


def random_model(
    normalization: str = "none", n_layers: int = 3, n_heads: int = 3, seed: int = 0
) -> AttentionOnlyTransformer:
    """A small model with random weights and, with normalization, random non-unit gains."""
    torch.manual_seed(seed)
    model = AttentionOnlyTransformer(
        TransformerShape(
            n_layers=n_layers, n_heads=n_heads, d_model=24, d_head=5, n_ctx=17, d_vocab=11, normalization=normalization
        )
    )
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
                module.weight.copy_(0.5 + torch.rand_like(module.weight))
    return model


NO_FIGURES = "figures=false"
"""What every test run starts with: the end-of-run report's numbers without its figures (~2.5 s of drawing
a run, a third of the suite's CPU when every run drew them). A test that looks at a run's figures says
``figures=true`` in its own overrides, which come after."""

NO_WANDB = "logger.wandb.enabled=false"
"""What every test run starts with too: no W&B run (~1.4 s to open and close an offline one, 5 in a
4-member ensemble's sweep). A test that reads a run's W&B files, or checks that none was started, says
:data:`WITH_WANDB` in its own overrides."""

WITH_WANDB = "logger.wandb.enabled=true"

NO_EXPLORER = "explorer=false"
"""What every test run starts with as well: no explorer page at its end (~0.13 s a 30-step run). A test
that reads a run's or a sweep's page says ``explorer=true`` in its own overrides."""


def train_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1", **extra)


def run_train_process(args: list[str], tmp_path: Path, timeout: int = 300, env: dict[str, str] | None = None):
    """``python train.py ARGS`` in a process of its own with its outputs under ``tmp_path`` (no figures and no W&B run
    unless ARGS ask: :data:`NO_FIGURES`, :data:`NO_WANDB`), started warm where ``env`` allows (:mod:`tests.warm_start`):
    for tests of the process itself (signals, exit codes, its environment); every other test trains in process
    (:func:`run_train`)."""
    from tests import warm_start

    command = [
        sys.executable,
        str(REPO / "train.py"),
        f"hydra.run.dir={tmp_path}",
        "trainer.enable_progress_bar=false",
        NO_FIGURES,
        NO_WANDB,
        *args,
    ]
    return warm_start.run(command, REPO, env or train_env(), timeout)


def run_tiny_sweep(directory: Path, *overrides: str) -> str:
    """``python train.py -m OVERRIDES`` of the tiny run (:data:`TINY`) into ``directory`` (in process:
    :func:`run_train`); asserts it succeeded and returns what it printed.
    ``overrides`` come after the tiny run's own, so they may change them (``explorer=true``)."""
    result = run_train(["-m", *TINY, *overrides], directory)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def run_train_until(
    args: list[str],
    step: int,
    signum: int,
    env: dict[str, str] | None = None,
    timeout: int = 300,
    multirun: bool = False,
):
    """Run ``python train.py [-m] ARGS`` in a process of its own, started warm where ``env`` allows
    (:mod:`tests.warm_start`; no figures and no W&B run unless ARGS ask: :data:`NO_FIGURES`, :data:`NO_WANDB`), and
    send it ``signum`` once it reports step ``step`` (a progress line every step). Returns (exit code, everything it
    printed)."""
    from tests import warm_start

    command = [
        sys.executable,
        str(REPO / "train.py"),
        *(["-m"] if multirun else []),
        "trainer.enable_progress_bar=true",
        "trainer.progress_every_n_steps=1",
        NO_FIGURES,
        NO_WANDB,
        *args,
    ]
    process = warm_start.popen(command, REPO, env or train_env(), subprocess.PIPE, subprocess.STDOUT)
    printed, sent = [], False
    try:
        for line in process.stdout:
            printed.append(line)
            if not sent and line.startswith(f"step {step}/"):
                process.send_signal(signum)
                sent = True
        return process.wait(timeout=timeout), "".join(printed)
    finally:
        if process.poll() is None:
            process.kill()


class CodeRunningPayload:
    """Unpickling this creates a file: what a crafted checkpoint would do to a careless loader."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# --- the tracker's settings --------------------------------------------------------------------


def tracker_settings(*dotlist: str):
    """The schema's ``tracker`` section (conf/schema.py, TrackerConfig) with ``dotlist`` overrides,
    e.g. ``tracker_settings("every_n_steps=5", "ablation.every_n_steps=15", "measures=[frobenius]")``."""
    from omegaconf import OmegaConf

    from conf.schema import TrackerConfig

    return OmegaConf.merge(OmegaConf.structured(TrackerConfig), OmegaConf.from_dotlist(list(dotlist)))


def tracker_of(probe, settings, run_dir=None):
    """The tracker ``settings`` (:func:`tracker_settings`) configure, on ``probe``, as train.py builds it."""
    from callbacks.tracker import CompositionTracker
    from conf.objects import build_quantities, from_config
    from metrics.tracked.options import TrackerOptions

    return CompositionTracker(probe, build_quantities(settings), from_config(TrackerOptions, settings), run_dir)


TINY = [  # a 60-step run that keeps its weights at 0, 1, 4, 15, 30, 60: for analyses of a finished run
    "trainer.max_steps=60",
    "tracker.every_n_steps=10",
    "tracker.all_measures.every_n_steps=30",
    "tracker.ablation.every_n_steps=30",
    "tracker.writes.every_n_steps=30",
    "tracker.matching.every_n_steps=30",
    "tracker.whitening.every_n_steps=30",
    "tracker.images.every_n_steps=0",
    "trajectory.log_steps=4",
    "trajectory.every_n_steps=30",
    "explorer=false",  # the explorer's tests write its page elsewhere (tests/reports/test_explorer.py)
]


def digest(run_dir) -> dict[str, str]:
    """Every file of a run directory outside ``analysis/``, by content hash; a link by where it points
    (W&B's ``logs/debug-core.log`` links to its service's log outside the run, which other runs of the
    same service, or another started in the same second, go on writing)."""
    return {
        str(p.relative_to(run_dir)): (
            f"-> {os.readlink(p)}" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
        )
        for p in sorted(run_dir.rglob("*"))
        if (p.is_file() or p.is_symlink()) and "analysis" not in p.relative_to(run_dir).parts
    }


def composed(*overrides: str):
    """The config ``train.py`` would run with ``overrides``, composed in-process (no validation)."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_train(
    args: list[str], run_dir: Path, threads: int | None = None, environ: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python [-m] train.py hydra.run.dir=RUN_DIR ARGS`` in this process: train.py's own ``main`` under its
    own ``StartupErrors``, as ``__main__`` runs it (Hydra composing the command line, the run guard, the
    job), without a new interpreter's ~6 s of imports; no figures, no W&B run and no explorer page
    unless ARGS ask (:data:`NO_FIGURES`, :data:`NO_WANDB`, :data:`NO_EXPLORER`). ``threads``: torch's threads for
    the run (as ``OMP_NUM_THREADS`` would set them in a subprocess); ``environ``: the run's whole
    environment (default: this one, W&B offline). Returns what a subprocess would (:func:`in_this_process`)."""
    flags = [a for a in args if a in ("-m", "--multirun")]  # before the overrides, as argparse wants them
    location = f"hydra.sweep.dir={run_dir}" if flags else f"hydra.run.dir={run_dir}"
    args = [a for a in args if a not in flags]
    argv = ["train.py", *flags, location, "trainer.enable_progress_bar=false", NO_FIGURES, NO_WANDB, NO_EXPLORER, *args]
    return in_this_process(train_as_main, argv, threads, environ)


def train_as_main() -> None:
    """train.py's ``main`` under its own ``StartupErrors``, as ``python train.py`` runs it (with
    :func:`in_this_process`: ``sys.argv`` its command line)."""
    import train
    from runtime.console import StartupErrors

    startup_errors, train.startup_errors = train.startup_errors, StartupErrors()
    try:
        with train.startup_errors:
            train.main()
    finally:
        train.startup_errors = startup_errors


def module(name: str, *args, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m NAME ARGS`` in this process (:func:`in_this_process`, ``environ`` its whole environment): the
    module run as ``__main__``."""
    import runpy

    run = lambda: runpy.run_module(name, run_name="__main__", alter_sys=True)
    return in_this_process(run, [name, *map(str, args)], environ=environ)


def in_this_process(
    main, argv: list[str], threads: int | None = None, environ: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``main()`` with ``sys.argv`` = ``argv`` and ``os.environ`` = ``environ`` (default: this process's, W&B
    offline), as a process would run it, returning what a subprocess would: the exit status (a
    ``SystemExit`` carrying a message counts as the interpreter counts it: the message on stderr, status
    1; an exception escaping: its traceback, status 1) and what it printed. What a run changes in the
    process (torch's threads and default dtype, the environment, the root logger's handlers,
    ``sys.argv``) is put back after it, and W&B's service ended."""
    import contextlib
    import logging
    import tempfile
    import traceback

    saved_argv, saved_environ = sys.argv, dict(os.environ)
    threads_before, dtype_before = torch.get_num_threads(), torch.get_default_dtype()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    if environ is None:
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    else:
        os.environ.clear()
        os.environ.update(environ)
    sys.argv = list(argv)
    if threads is not None:
        torch.set_num_threads(threads)
    code = 0
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    main()
                except SystemExit as exit:
                    if isinstance(exit.code, str):
                        print(exit.code, file=sys.stderr)
                    code = 1 if isinstance(exit.code, str) else exit.code or 0
                except Exception:
                    traceback.print_exc()
                    code = 1
        finally:
            if "wandb" in sys.modules:  # W&B's service ends as at a process's exit: its log is the run's alone
                sys.modules["wandb"].teardown()
            sys.argv = saved_argv
            os.environ.clear()
            os.environ.update(saved_environ)
            os.environ.pop("WANDB_SERVICE", None)  # the service ended above, whoever started it
            torch.set_num_threads(threads_before)
            torch.set_default_dtype(dtype_before)
            root.handlers[:], root.level = handlers, level
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())


def run_refused(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """:func:`run_train` of input that train.py must refuse before any work (no training: not a slow test),
    W&B on as a user's default, so that "no W&B run was started" is checked, not given."""
    return run_train([WITH_WANDB, *args], run_dir)


def random_low_rank(n: int, d_model: int, d_head: int, generator: torch.Generator):
    """``n`` products of two i.i.d. standard Gaussian ``[d_model, d_head]`` factors, float64: the direct
    sampler the random baselines' ``d_head``-space sampler (``metrics.composition.baseline``) is tested against."""
    from metrics.composition.circuits import LowRank

    draw = lambda: torch.randn(n, d_model, d_head, generator=generator, dtype=torch.float64)
    return LowRank(draw(), draw())
