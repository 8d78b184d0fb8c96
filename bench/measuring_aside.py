"""Would a tracker that measures in a process of its own cost training less than the tracker in it?
Training's throughput alone against training while a second process takes the default tracker's
snapshots at the rate a run asks for them, on the default experiment.

    python -m bench.measuring_aside [--steps 600] [--repeats 3] [--period-ms 115] [--out results.json]

A  alone      ``trainer.fit`` of the default experiment without tracker (as ``bench.throughput``'s "lightning")
B  aside      the same, while a forked process on one torch thread loads a copy of the weights (pickled, as
              a pipe would carry them) and takes a snapshot every ``--period-ms`` (default: the default
              run's, a snapshot every 10 steps of ~11.5 ms; strategies every other one), sleeping between

Interleaved (A, B, A, B, ...) after one untimed round; the median of each. On the machine this was
written for (2 cores) training uses both cores' threads, and B slowed it by 21-41 % against the ~9 % the
tracker costs in the process; with ``OMP_NUM_THREADS=1`` B cost 5 %, but training alone on one thread took
20 % longer than on two (bench/README.md, "The cost of an iteration"): measuring aside pays only where
cores are left over.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.results_file import check_out, write_results
from bench.throughput import compose_config, make_tracker, quiet_lightning, run_lightning
from runtime.build import build_module

WARMUP_ROUND_STEPS = 30
SNAPSHOT_STEPS = 10  # the default tracker's period; every other snapshot also reads the strategies


def take_snapshots(cfg, period_s: float, stop, counted) -> None:
    """In the forked process: a snapshot of a fresh copy of the weights every ``period_s`` until ``stop``."""
    torch.set_num_threads(1)  # the parent's OpenMP team is not in a forked child
    module = build_module(cfg)
    tracker = make_tracker(cfg)
    tracker.open(module.model, 0)
    weights = {name: tensor.clone() for name, tensor in module.model.state_dict().items()}
    taken = 0
    while not stop.is_set():
        started = time.perf_counter()
        module.model.load_state_dict(pickle.loads(pickle.dumps(weights)))
        tracker.snapshot([], module.model, SNAPSHOT_STEPS * (1 + taken % 9), last=False)
        taken += 1
        time.sleep(max(0.0, period_s - (time.perf_counter() - started)))
    counted.value = taken


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--period-ms", type=float, default=115.0, help="milliseconds between the aside snapshots")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    if args.steps < 1 or args.repeats < 1 or args.period_ms < 0:
        parser.error("--steps and --repeats must be >= 1, --period-ms >= 0")
    if sys.platform != "linux":
        parser.error("forks a measuring process: Linux only")
    quiet_lightning()
    cfg = compose_config(args.steps, [])
    fork = multiprocessing.get_context("fork")
    run_lightning(cfg, WARMUP_ROUND_STEPS)  # untimed: one-time costs
    seconds: dict[str, list[float]] = {"alone": [], "aside": []}
    snapshots = []
    for repeat in range(args.repeats):
        seconds["alone"].append(run_lightning(cfg, args.steps))
        stop, counted = fork.Event(), fork.Value("i", 0)
        process = fork.Process(target=take_snapshots, args=(cfg, args.period_ms / 1000, stop, counted))
        process.start()
        time.sleep(3)  # its model, probe and first snapshot ready
        seconds["aside"].append(run_lightning(cfg, args.steps))
        stop.set()
        process.join()
        snapshots.append(counted.value)
        print(f"repeat {repeat}: alone {seconds['alone'][-1]:.2f} s, aside {seconds['aside'][-1]:.2f} s", flush=True)
    alone, aside = (statistics.median(seconds[k]) for k in ("alone", "aside"))
    print(
        f"\ntorch threads {torch.get_num_threads()}; {args.steps} steps; a snapshot aside every {args.period_ms:g} ms"
        f" ({min(snapshots)}-{max(snapshots)} a run, the first 3 s included)"
    )
    print(f"alone {alone:.2f} s, aside {aside:.2f} s (medians of {args.repeats}): training {aside / alone - 1:+.1%}")
    results = {"steps": args.steps, "period_ms": args.period_ms, "seconds": seconds, "slowdown": aside / alone - 1}
    if args.out is not None:
        write_results(args.out, "measuring_aside", results)
    return results


if __name__ == "__main__":
    main()
