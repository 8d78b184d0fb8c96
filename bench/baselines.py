"""Random baselines at paper scale: every measure's baseline for one shape, cold (sampled) and warm
(read from the disk cache), timed in one process.

    python -m bench.baselines [--d-model 768] [--d-head 64] [--samples 2000] [--repeats 3]

Cold runs sample into a fresh temporary cache directory each time; warm runs read the file the
cold run wrote (the in-process cache is cleared before every run, so each one pays what a new
process pays). Targets: cold <= 5 s for all measures, warm <= 10 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from metrics.composition import baseline
from metrics.composition.baseline import random_baselines

MAX_COLD_SECONDS, MAX_WARM_SECONDS = 5.0, 0.010


def timed(d_model: int, d_head: int, samples: int) -> float:
    random_baselines.cache_clear()
    start = time.perf_counter()
    random_baselines(d_model, d_head, samples, 0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    cold, warm = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            os.environ[baseline.CACHE_ENV] = cache
            cold.append(timed(args.d_model, args.d_head, args.samples))
            warm.append(timed(args.d_model, args.d_head, args.samples))
    values = random_baselines(args.d_model, args.d_head, args.samples, 0)
    print(f"command: python -m bench.baselines {' '.join(sys.argv[1:])}")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; d_model {args.d_model}, d_head {args.d_head},"
        f" {args.samples} samples, every measure ({len(values)}) from one sampling pass"
    )
    for name, b in values.items():
        print(f"  {name:<16} {b.mean:.5f} ± {b.stderr:.5f}")
    median_cold, median_warm = statistics.median(cold), statistics.median(warm)
    met = lambda ok: "met" if ok else "NOT met"
    print(
        f"cold: median {median_cold:.2f} s over {args.repeats} ({', '.join(f'{c:.2f}' for c in cold)});"
        f" target <= {MAX_COLD_SECONDS:g} s: {met(median_cold <= MAX_COLD_SECONDS)}"
    )
    print(
        f"warm: median {1000 * median_warm:.2f} ms ({', '.join(f'{1000 * w:.2f}' for w in warm)});"
        f" target <= {1000 * MAX_WARM_SECONDS:g} ms: {met(median_warm <= MAX_WARM_SECONDS)}"
    )
    return 0 if median_cold <= MAX_COLD_SECONDS and median_warm <= MAX_WARM_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
