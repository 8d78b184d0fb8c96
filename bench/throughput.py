"""Training throughput of the default experiment: bare PyTorch vs. the Lightning pipeline vs.
Lightning with the composition tracker, on the same model, batch and data.

    python -m bench.throughput [--steps 600] [--repeats 3] [--out results.json] [OVERRIDE ...]

OVERRIDEs are Hydra overrides of the default experiment, e.g. the lean tracker:
``"tracker.measures=[frobenius]" tracker.ablation.every_n_steps=0``.

A  bare               AttentionOnlyTransformer, AdamW (+ the config's linear warmup), clip_grad_norm_(1.0),
                      next_token_loss, batches from the training TokenStream; timed after a few warm-up steps.
B  lightning          runtime.build's module and datamodule in an L.Trainer set up as build_trainer sets it up,
                      but with no logger, checkpointing, progress bar or tracker; trainer.fit timed end to end.
C  lightning+tracker  B plus CompositionTracker as configured (default: Frobenius every 10 steps, every
                      other measure and the expensive parts every 100; the snapshot's keys are built but,
                      with no logger, not written; no tensor store, no images).

Setups run interleaved (A, B, C, A, B, C, ...) after one untimed round that pays one-time costs
(lazy imports, the tracker's cached random baseline); tokens/s = steps * batch_size * seq_len / seconds,
median over repeats. Targets: lightning / bare >= 0.9, tracker overhead 1 - C / B <= 5 % (the default
shape; ``--max-overhead 0.10`` for 4 layers x 8 heads x d_model 256 x d_head 32). The tracker's own
ledger says what each part cost (ms per run of the part, and its share of a tracker-free run), and
from it the steady-state overhead of a long run: each part at its own period, without the full
snapshots (ablation, what heads write, matching) that a run takes at its first and last step, which a run of
a few hundred steps pays in full; against the median Lightning run and against the fastest (a host
that steals time only lengthens a run, and a longer denominator flatters the tracker).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import hydra  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from bench.results_file import check_out, write_results
from callbacks.tracker import CompositionTracker, tracker_from_config  # noqa: E402
from conf.objects import build_sampler, model_shape  # noqa: E402
from conf.schema import register_schemas  # noqa: E402
from conf.validate import ConfigError, validate  # noqa: E402
from data.datamodule import TokenStream  # noqa: E402
from models.lit_module import next_token_loss  # noqa: E402
from models.transformer import AttentionOnlyTransformer  # noqa: E402
from runtime.build import build_datamodule, build_module, silence_known_warnings  # noqa: E402

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SETUPS = ("bare", "lightning", "lightning+tracker")
BARE_WARMUP_STEPS = 10
WARMUP_ROUND_STEPS = 30
MIN_LIGHTNING_RATIO = 0.9
MAX_TRACKER_OVERHEAD = 0.05


def compose_config(steps: int, extra: list[str]) -> DictConfig:
    """The default experiment's config with the ``extra`` overrides, ``steps`` optimizer steps and no heatmap images."""
    register_schemas()
    overrides = [
        *extra,
        f"trainer.max_steps={steps}",
        "trainer.enable_progress_bar=false",
        "tracker.images.every_n_steps=0",
    ]
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=overrides)
    validate(cfg)
    return cfg


def run_bare(cfg: DictConfig, steps: int, changes: dict | None = None) -> float:
    """Seconds for ``steps`` optimizer steps of a plain torch loop, after a few untimed warm-up steps;
    ``changes``: training-time interventions set on the model (``bench/interventions.py``)."""
    data, optim = cfg.data, cfg.optim
    torch.manual_seed(cfg.seed)
    model = AttentionOnlyTransformer(model_shape(cfg), init=str(cfg.model.init.value), init_std=cfg.model.init_std)
    model.set_changes(changes or {})
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
    )
    # InductionLM.configure_optimizers adds this warmup; keep it so both loops do the same work per step
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(optim.warmup_steps, 1))
    )
    batches = iter(TokenStream(build_sampler(cfg), data.batch_size))

    def step() -> None:
        tokens = next(batches)
        loss = next_token_loss(model(tokens), tokens)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        warmup.step()

    for _ in range(BARE_WARMUP_STEPS):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return time.perf_counter() - start


def make_tracker(cfg: DictConfig) -> CompositionTracker:
    """The tracker as the config sets it up, without a tensor store (no run directory) or cost report."""
    tracker = tracker_from_config(cfg, run_dir=None)
    tracker.cost_report = False
    return tracker


def run_lightning(cfg: DictConfig, steps: int, tracker: CompositionTracker | None = None) -> float:
    """Seconds for ``trainer.fit`` end to end (Lightning's own setup and teardown included)."""
    torch.manual_seed(cfg.seed)
    module, datamodule = build_module(cfg), build_datamodule(cfg)
    assert module.model.shape == model_shape(cfg), "bare and Lightning must train the same model"
    t = cfg.trainer
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            default_root_dir=root,
            max_steps=steps,
            accelerator=t.accelerator,
            devices=t.devices,
            precision=t.precision,
            gradient_clip_val=t.gradient_clip_val,
            accumulate_grad_batches=t.accumulate_grad_batches,
            log_every_n_steps=t.log_every_n_steps,
            deterministic=t.deterministic,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[tracker] if tracker else [],
        )
        start = time.perf_counter()
        trainer.fit(module, datamodule=datamodule)
        seconds = time.perf_counter() - start
    assert trainer.global_step == steps, f"trained {trainer.global_step} steps, not {steps}"
    if tracker is not None:
        # with no logger the tracker still computes every snapshot; its last one is of the final weights
        assert tracker.last_step == steps, f"tracker's last snapshot at step {tracker.last_step}, not {steps}"
    return seconds


def run_setup(name: str, cfg: DictConfig, steps: int) -> tuple[float, CompositionTracker | None]:
    """Seconds of one run of setup ``name``, and its tracker (whose ledger says what each part cost)."""
    if name == "bare":
        return run_bare(cfg, steps), None
    tracker = make_tracker(cfg) if name == "lightning+tracker" else None
    return run_lightning(cfg, steps, tracker), tracker


def quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*no logger configured.*")
    silence_known_warnings()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="timed optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setup; the median is reported")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--max-overhead",
        type=float,
        default=MAX_TRACKER_OVERHEAD,
        help="tracker overhead target to report against (default 0.05)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the default experiment")
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1")
    quiet_lightning()

    try:
        cfg = compose_config(args.steps, args.overrides)
    except (ConfigError, HydraException, OmegaConfBaseException) as error:
        parser.error(f"bad override: {error}")
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    for name in SETUPS:  # untimed: first-call costs are no part of steady throughput
        run_setup(name, cfg, WARMUP_ROUND_STEPS)
    seconds: dict[str, list[float]] = {name: [] for name in SETUPS}
    trackers = []
    for _ in range(args.repeats):
        for name in SETUPS:
            elapsed, tracker = run_setup(name, cfg, args.steps)
            seconds[name].append(elapsed)
            if tracker is not None:
                trackers.append(tracker)
    ledgers = [tracker.cost.ledger for tracker in trackers]

    median_s = {name: statistics.median(s) for name, s in seconds.items()}
    tokens_per_s = {name: args.steps * tokens_per_step / s for name, s in median_s.items()}
    ratio = tokens_per_s["lightning"] / tokens_per_s["bare"]
    overhead = 1 - tokens_per_s["lightning+tracker"] / tokens_per_s["lightning"]
    parts = sorted({p for ledger in ledgers for p in ledger.seconds})
    part_ms = {
        p: statistics.median(1000 * lg.seconds.get(p, 0) / max(lg.runs.get(p, 1), 1) for lg in ledgers) for p in parts
    }
    part_runs = {p: ledgers[-1].runs.get(p, 0) for p in parts}
    part_share = {p: statistics.median(lg.seconds.get(p, 0) for lg in ledgers) / median_s["lightning"] for p in parts}
    # what a long run pays: each part at its own period, without the full snapshots this short run
    # was also forced to take at its first and last step
    per_step = trackers[-1].cost.amortised_seconds_per_step({p: ms / 1000 for p, ms in part_ms.items()})
    steady = sum(per_step.values()) / (median_s["lightning"] / args.steps)
    # a disturbed Lightning run only ever takes longer: against the fastest one, the reading a busy host cannot lower
    steady_fastest = sum(per_step.values()) / (min(seconds["lightning"]) / args.steps)

    model = cfg.model
    command = shlex.join(sys.orig_argv)
    print(f"command: {command}")
    print(f"torch {torch.__version__}, lightning {L.__version__}, torch.get_num_threads() = {torch.get_num_threads()}")
    print(
        f"model: {model.n_layers} layers x {model.n_heads} heads, d_model {model.d_model}, d_head {model.d_head}, d_vocab {model.d_vocab};"
        f" batch {cfg.data.batch_size} x {cfg.data.seq_len} = {tokens_per_step} tokens/step;"
        f" {args.steps} steps x {args.repeats} repeats, interleaved"
    )
    print(
        f"timed: bare = {args.steps} steps after {BARE_WARMUP_STEPS} warm-up steps; lightning = trainer.fit end to end\n"
    )
    print(f"{'setup':<20}{'tokens/s':>10}{'seconds':>9}   per repeat (s)")
    for name in SETUPS:
        runs = " ".join(f"{s:.2f}" for s in seconds[name])
        print(f"{name:<20}{tokens_per_s[name]:>10,.0f}{median_s[name]:>9.2f}   {runs}")
    met = lambda ok: "met" if ok else "not met"
    print(f"\nlightning / bare   {ratio:>7.3f}   target >= {MIN_LIGHTNING_RATIO}  {met(ratio >= MIN_LIGHTNING_RATIO)}")
    print(
        f"tracker overhead   {overhead:>7.1%}   target <= {args.max_overhead:.0%}   {met(overhead <= args.max_overhead)}"
    )
    print(
        f"  steady state     {steady:>7.1%}   (from the ledger: each part at its own period, none of the full snapshots"
        f" forced at a run's first and last step); {steady_fastest:.1%} against the fastest Lightning run"
    )
    print(
        f"\ntracker parts (median over the tracked runs; every_n_steps {cfg.tracker.every_n_steps}, measures {list(cfg.tracker.measures)}):"
    )
    print(f"  {'part':<20}{'runs':>6}{'ms each':>10}{'% of a run':>12}")
    for p in parts:
        print(f"  {p:<20}{part_runs[p]:>6}{part_ms[p]:>10.2f}{part_share[p]:>12.1%}")

    results = {
        "command": command,
        "torch": torch.__version__,
        "lightning": L.__version__,
        "num_threads": torch.get_num_threads(),
        "steps": args.steps,
        "repeats": args.repeats,
        "tokens_per_step": tokens_per_step,
        "timing": {
            "bare": f"{args.steps} steps after {BARE_WARMUP_STEPS} warm-up steps",
            "lightning": "trainer.fit end to end",
        },
        "seconds": seconds,
        "median_seconds": median_s,
        "tokens_per_s": tokens_per_s,
        "lightning_over_bare": ratio,
        "lightning_over_bare_met": ratio >= MIN_LIGHTNING_RATIO,
        "tracker_overhead": overhead,
        "tracker_overhead_met": overhead <= args.max_overhead,
        "tracker_overhead_steady_state": steady,
        "tracker_overhead_steady_state_fastest": steady_fastest,
        "max_tracker_overhead": args.max_overhead,
        "tracker_part_ms": part_ms,
        "tracker_part_runs": part_runs,
        "tracker_part_share_of_run": part_share,
        "tracker_measures": list(cfg.tracker.measures),
    }
    if args.out is not None:
        write_results(args.out, "throughput", results)
    return results


if __name__ == "__main__":
    main()
