"""Every head's refined LLC at one step, batched, against one head after another and one whole-model estimate.

    python -m bench.refined_llc [--shape default|head_types|elhage_2l] [--train-steps N] [--repeats R]
                                [--threads N] [--device cpu|cuda] [--out FILE] [--overrides OVERRIDE ...]

The model of ``--shape`` (the default experiment, or ``experiment=head_types`` / ``experiment=elhage_2l``;
``--overrides`` adds any other Hydra override) at its initialisation, or after ``--train-steps`` steps of
a bare AdamW loop on its training data, float32. The SGLD settings are the config's ``stages.llc``
(ε, γ, nβ, chains, draws, burn-in, batch) on its ``batches × batch_size`` held-out sequences. Timed,
wall seconds, interleaved over ``--repeats`` (medians), after one untimed short round of each (imports,
first calls):

- **batched**: :func:`metrics.dynamics.refined_llc.refined_llcs` for every head at once (``groups=heads``),
  and for every head, every layer and the model at once (``all groups``);
- **one head after another**: :func:`metrics.dynamics.llc.llc_record` with each head's ``head_masks``
  (devinterp's ``sample``, as ``analysis.stages`` runs a circuit head today), summed over the heads;
- **the whole model once**: :func:`~metrics.dynamics.llc.llc_record` without masks.

Also printed: each head's λ̂ both ways (the same chains: they agree to float32 rounding) and, for the
batched runs, the GEMM FLOP rate they reach (:func:`metrics.dynamics.refined_llc.step_flops`: forward and
backward of every member, from its first moving layer) as a share of the device's best fp32 ``[8192, 768] x [768, 768]`` GEMM
(:func:`bench.composition.gemm_flop_rate` on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.results_file import check_out, write_results

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SHAPES = ("default", "head_types", "elhage_2l")


def compose(shape: str, overrides: list[str]):
    """The config of ``--shape`` (``experiment=SHAPE`` unless ``default``) with ``overrides``, validated."""
    import hydra

    from conf.schema import register_schemas
    from conf.validate import validate

    register_schemas()
    given = ([] if shape == "default" else [f"experiment={shape}"]) + overrides
    if shape != "default" and not (CONF_DIR / "experiment" / f"{shape}.yaml").is_file():
        raise SystemExit(f"refined_llc: no preset conf/experiment/{shape}.yaml in this checkout")
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra.compose("config", overrides=given)
    validate(cfg)
    return cfg


def build_model(cfg, train_steps: int, device: torch.device):
    """The run's model at its initialisation (``cfg.seed``), then ``train_steps`` steps of AdamW (the
    config's lr, weight decay and betas, no warm-up) on its training batches."""
    from conf.objects import build_sampler, model_shape
    from data.datamodule import TokenStream
    from models.lit_module import next_token_loss
    from models.transformer import AttentionOnlyTransformer

    torch.manual_seed(cfg.seed)
    model = AttentionOnlyTransformer(model_shape(cfg), init=str(cfg.model.init.value), init_std=cfg.model.init_std)
    model = model.to(device)
    if train_steps:
        optim = cfg.optim
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
        )
        batches = iter(TokenStream(build_sampler(cfg), cfg.data.batch_size))
        for _ in range(train_steps):
            tokens = next(batches).to(device)
            loss = next_token_loss(model(tokens), tokens)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.requires_grad_(True)


def gemm_rate(device: torch.device) -> float:
    """FLOP/s of the device's best fp32 ``[8192, 768] x [768, 768]`` GEMM (on the CPU,
    :func:`bench.composition.gemm_flop_rate`)."""
    if device.type == "cpu":
        from bench.composition import gemm_flop_rate

        return gemm_flop_rate()
    a, b = torch.randn(8192, 768, device=device), torch.randn(768, 768, device=device)
    times = [timed(lambda: a @ b, device)[1] for _ in range(6)]
    return 2 * 8192 * 768 * 768 / min(times[1:])


def timed(job, device: torch.device):
    """``(result, wall seconds)`` of ``job()``, the device synchronised on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = job()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="default", help="the experiment preset (default: none)")
    parser.add_argument("--overrides", nargs="*", default=[], help="more Hydra overrides, e.g. stages.llc.draws=50")
    parser.add_argument("--train-steps", type=int, default=0, help="AdamW steps before the estimates (0: at init)")
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds, interleaved (medians)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    if args.threads:
        torch.set_num_threads(args.threads)

    from conf.objects import llc_sequences, sgld_settings
    from metrics.dynamics.llc import llc_record, require_devinterp
    from metrics.dynamics.refined_llc import group_masks, group_names, refined_llcs, step_flops

    require_devinterp()
    device = torch.device(args.device)
    cfg = compose(args.shape, args.overrides)
    model = build_model(cfg, args.train_steps, device)
    settings, tolerance = sgld_settings(cfg.stages.llc), float(cfg.stages.llc.settle_tolerance)
    rows = llc_sequences(cfg).to(device)
    shape = model.shape
    heads = group_names(shape, ["heads"])
    every = group_names(shape)
    print(
        f"refined_llc: {args.shape} ({shape.n_layers} × {shape.n_heads} × {shape.d_model} × {shape.d_head}, vocabulary"
        f" {shape.d_vocab}), {'step 0' if not args.train_steps else f'after {args.train_steps} steps'}, {device},"
        f" {torch.get_num_threads()} threads; ε {settings.lr:g}, γ {settings.localization:g}, nβ {settings.n_beta:.3g},"
        f" {settings.chains} chains × ({settings.burnin} + {settings.draws}) steps, {rows.shape[0]} sequences ×"
        f" {rows.shape[1]} in batches of {settings.batch_size}",
        flush=True,
    )

    def batched(groups: list[str], s=settings):
        return refined_llcs(model, rows, s, tolerance, groups)

    def serial(s=settings):
        return {name: llc_record(model, rows, s, tolerance, group_masks(model, name)) for name in heads}

    def whole(s=settings):
        return llc_record(model, rows, s, tolerance)

    short = dataclasses.replace(settings, draws=3, burnin=0, chains=1)
    batched(every, short), serial(short), whole(short)  # untimed: imports, first calls
    seconds: dict[str, list[float]] = {"batched_heads": [], "batched_all": [], "serial_heads": [], "model": []}
    for _ in range(args.repeats):
        batched_heads, t = timed(lambda: batched(heads), device)
        seconds["batched_heads"].append(t)
        batched_all, t = timed(lambda: batched(every), device)
        seconds["batched_all"].append(t)
        one_by_one, t = timed(serial, device)
        seconds["serial_heads"].append(t)
        model_record, t = timed(whole, device)
        seconds["model"].append(t)
    median = {name: statistics.median(values) for name, values in seconds.items()}

    steps, batch, seq = settings.burnin + settings.draws, settings.batch_size, rows.shape[1]
    flops = {}
    for name, groups in (("batched_heads", heads), ("batched_all", every)):
        per_step = sum(step_flops(shape, batch, seq, group_masks(model, group)) for group in groups)
        flops[name] = settings.chains * steps * per_step
    rate = gemm_rate(device)
    achieved = {name: flops[name] / median[name] for name in flops}
    agreement = max(abs(batched_heads[n]["mean"] - one_by_one[n]["mean"]) for n in heads)
    scale = max(abs(one_by_one[n]["mean"]) for n in heads)
    print(
        f"refined_llc: {len(heads)} heads × {settings.chains} chains = {len(heads) * settings.chains} members;"
        f" all groups ({len(every)}: heads, layers, model) = {len(every) * settings.chains} members"
    )
    print(f"refined_llc: wall seconds (median of {args.repeats}):")
    print(f"  every head, batched                    {median['batched_heads']:8.2f}")
    print(f"  every head, layer and the model, batched {median['batched_all']:6.2f}")
    print(f"  one head after another (devinterp)     {median['serial_heads']:8.2f}")
    print(f"  the whole model, one estimate          {median['model']:8.2f}")
    print(
        f"refined_llc: every head batched is {median['serial_heads'] / median['batched_heads']:.1f}× faster than one"
        f" after another and costs {median['batched_heads'] / median['model']:.2f} whole-model estimates"
    )
    print(
        f"refined_llc: GEMM FLOPs (forward + backward of every member): heads {flops['batched_heads']:.3g} at"
        f" {achieved['batched_heads'] / 1e9:.1f} GFLOP/s, all groups {flops['batched_all']:.3g} at"
        f" {achieved['batched_all'] / 1e9:.1f} GFLOP/s; the device's fp32 GEMM {rate / 1e9:.1f} GFLOP/s:"
        f" {achieved['batched_heads'] / rate:.1%} / {achieved['batched_all'] / rate:.1%} of it"
    )
    print("refined_llc: λ̂ per head, batched / one at a time (± chains' std):")
    for name in heads:
        a, b = batched_heads[name], one_by_one[name]
        print(f"  {name:<6} {a['mean']:9.4f} ± {a['std']:.4f} / {b['mean']:9.4f} ± {b['std']:.4f}")
    layers = ", ".join(f"{n} {batched_all[n]['mean']:.3f}" for n in every if n not in heads and n != "model")
    print(
        f"refined_llc: largest |difference| of a head's λ̂ {agreement:.2e} ({agreement / scale:.1e} of the largest);"
        f" λ̂ of the layers {layers}; of the model {batched_all['model']['mean']:.3f} batched,"
        f" {model_record['mean']:.3f} by estimate_llc"
    )
    results = {
        "shape": args.shape,
        "overrides": args.overrides,
        "train_steps": args.train_steps,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "settings": dataclasses.asdict(settings),
        "seconds": seconds,
        "median_seconds": median,
        "gemm_flops": flops,
        "achieved_flop_rate": achieved,
        "device_gemm_flop_rate": rate,
        "batched_heads": batched_heads,
        "batched_all": batched_all,
        "serial_heads": one_by_one,
        "model": model_record,
        "largest_head_difference": agreement,
    }
    if args.out:
        write_results(args.out, "refined_llc", results)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
