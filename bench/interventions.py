"""What a training-time intervention costs per training step: the default experiment's training
loop with no intervention (the fused attention path), with one pattern clamp, and with one ablation.

    python -m bench.interventions [--steps 300] [--repeats 5] [--max-ratio 1.5] [OVERRIDE ...]

Each setup is :func:`bench.throughput.run_bare` (AdamW, warmup, clipping, the training stream) with
``model.set_changes`` set once, as the intervention callback does; setups run interleaved (none,
clamp, ablate, none, ...) after one untimed round; the median seconds per step over repeats. Target:
a clamp costs at most ``--max-ratio`` (1.5) times a step without intervention. Exit 1 when it is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from bench.results_file import check_out, write_results
from bench.throughput import compose_config, run_bare
from models.interventions import HeadChange

SETUPS = {
    "none": {},
    "clamp L0H0 prev_token": {0: [HeadChange(0, "clamp", "prev_token")]},
    "clamp L1H0 induction": {1: [HeadChange(0, "clamp", "induction")]},
    "ablate L0H0 mean": {0: [HeadChange(0, "ablate", replacement="mean")]},
}
MAX_RATIO = 1.5


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each setup; the median is reported")
    parser.add_argument("--max-ratio", type=float, default=MAX_RATIO, help="target: clamp / none at most this")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the default experiment")
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    cfg = compose_config(args.steps, args.overrides)
    seconds: dict[str, list[float]] = {name: [] for name in SETUPS}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps x {args.repeats} repeats")
    for round_ in range(args.repeats + 1):
        for name, changes in SETUPS.items():
            took = run_bare(cfg, args.steps, changes) if round_ else run_bare(cfg, 20, changes)
            if round_:  # the first round pays one-time costs and is not counted
                seconds[name].append(took)
    base = statistics.median(seconds["none"]) / args.steps
    results = {}
    print(f"{'setup':24s} {'ms/step':>8s} {'vs none':>8s}")
    for name, runs in seconds.items():
        per_step = statistics.median(runs) / args.steps
        results[name] = {"ms_per_step": 1e3 * per_step, "ratio": per_step / base, "runs_s": runs}
        print(f"{name:24s} {1e3 * per_step:8.2f} {per_step / base:7.2f}x")
    worst = max(r["ratio"] for n, r in results.items() if n.startswith("clamp"))
    ok = worst <= args.max_ratio
    print(f"clamp / none: {worst:.2f}x (target <= {args.max_ratio}x): {'met' if ok else 'MISSED'}")
    if args.out:
        write_results(args.out, "interventions", {"steps": args.steps, "repeats": args.repeats, "results": results})
    if not ok:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
