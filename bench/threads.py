"""What changing torch's thread count mid-run does to the training steps after it: each setting is
applied once, between two stretches of training steps of the same model and batch, in a fresh
process; the table gives the median step after it over the median step before it.

    python -m bench.threads [--repeats 2] [--steps 80] [--out results.json] [OVERRIDE ...]

Settings: ``none`` (nothing), ``torch_same`` (``torch.set_num_threads`` to the count in force),
``torch_1_back`` (to 1 for a few steps, then back: what a snapshot on one thread did), and
``openmp_1_back`` (the same switch by OpenMP's own ``omp_set_num_threads``, through threadpoolctl: what
the tracker does, ``callbacks/tracker.py``). OVERRIDEs are Hydra overrides of the model (default
4 layers x 8 heads x d_model 256 x d_head 32). With torch's MKL, ``torch.set_num_threads`` also turns
MKL's dynamic threading off, which is what slows the later steps (docs/operations.md, "Threads").
Settings run interleaved (none, torch_same, ..., none, ...), one process each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench.results_file import check_out, write_results
from bench.startup import REPO

SETTINGS = ("none", "torch_same", "torch_1_back", "openmp_1_back")
SHAPE = ["model.n_layers=4", "model.n_heads=8", "model.d_model=256", "model.d_head=32"]
WARM_UP = 10


def step_times(overrides: list[str], setting: str, steps: int) -> tuple[float, float]:
    """Median seconds of a training step (forward, loss, backward, AdamW) before and after ``setting``,
    ``steps // 2`` steps before and ``steps`` after, on one batch of the configured data."""
    import torch
    from hydra import compose, initialize_config_dir

    from conf.schema import register_schemas
    from models.lit_module import next_token_loss
    from runtime.build import build_datamodule, build_module

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    torch.manual_seed(0)
    module = build_module(cfg)
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=1e-3)
    datamodule = build_datamodule(cfg)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))

    def train(n: int) -> float:
        seconds = []
        for _ in range(n):
            started = time.perf_counter()
            loss = next_token_loss(module.model(batch), batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds)

    train(WARM_UP)
    before = train(steps // 2)
    threads = torch.get_num_threads()
    if setting == "torch_same":
        torch.set_num_threads(threads)
    elif setting == "torch_1_back":
        torch.set_num_threads(1)
        train(3)
        torch.set_num_threads(threads)
    elif setting == "openmp_1_back":
        from threadpoolctl import ThreadpoolController

        with ThreadpoolController().limit(limits=1, user_api="openmp"):
            train(3)
    return before, train(steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80, help="timed steps after the setting (half as many before)")
    parser.add_argument("--out", type=str)
    parser.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)  # one measurement, in this process
    parser.add_argument("overrides", nargs="*", help=f"model overrides (default: {' '.join(SHAPE)})")
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    overrides = args.overrides or SHAPE
    if args.setting:
        print(json.dumps(step_times(overrides, args.setting, args.steps)))
        return 0
    if args.repeats < 1 or args.steps < 2:
        parser.error("--repeats must be >= 1 and --steps >= 2")
    ratios: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    for repeat in range(args.repeats):
        for setting in SETTINGS:
            command = [
                sys.executable,
                "-m",
                "bench.threads",
                "--setting",
                setting,
                "--steps",
                str(args.steps),
                *overrides,
            ]
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            if result.returncode != 0:
                raise SystemExit(f"error: {setting} exited {result.returncode}: {result.stderr.strip()[-500:]}")
            before, after = json.loads(result.stdout.strip().splitlines()[-1])
            ratios[setting].append(after / before)
            print(f"repeat {repeat}: {setting:14s} {before * 1e3:6.1f} -> {after * 1e3:6.1f} ms a step", flush=True)
    print(f"\nmedian step after / before ({args.repeats} processes each, {' '.join(overrides)}):")
    for setting, values in ratios.items():
        print(f"  {setting:14s} {statistics.median(values):.3f}   ({', '.join(f'{v:.3f}' for v in values)})")
    if args.out:
        write_results(args.out, "threads", {"overrides": overrides, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
