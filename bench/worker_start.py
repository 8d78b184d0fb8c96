"""How long the ensemble launcher's worker processes take to start (``hydra.launcher.n_jobs`` >= 2):
from ``Process.start()`` to the worker having what it trains with (Lightning, ``runtime.build``, the
ensemble's module and callbacks), and the worker's own CPU for it, under ``spawn`` and under the fork
server with the launcher's preload (:func:`runtime.ensemble_job.worker_context`).

    python -m bench.worker_start [--workers 4] [--out results.json]

Workers are started one after another in one launcher per start method. The fork server's first
worker also waits for the server's own imports (a one-time cost per launch); the later ones fork.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

from bench.results_file import check_out, write_results
from runtime.ensemble_job import WORKER_PRELOAD, worker_context


def ready(send, started: float) -> None:
    """A worker: import what a worker of :func:`runtime.ensemble_job.fit_part` trains with, then report
    the seconds since ``started`` and its own CPU seconds."""
    for module in WORKER_PRELOAD:
        __import__(module)
    cpu = os.times()
    send.send((time.time() - started, cpu.user + cpu.system))


def start_one(context) -> tuple[float, float]:
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=ready, args=(send, time.time()))
    process.start()
    send.close()
    outcome = receive.recv()
    process.join()
    return outcome


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="workers started per start method")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    if args.workers < 2:
        parser.error("--workers must be >= 2 (the first and the later ones)")
    results = {}
    for method, context in (("spawn", multiprocessing.get_context("spawn")), ("forkserver", worker_context())):
        if context.get_start_method() != method:
            print(f"{method}: not available here")
            continue
        starts = [start_one(context) for _ in range(args.workers)]
        later = starts[1:]
        results[method] = {"first": starts[0], "later_median": [statistics.median(x) for x in zip(*later)]}
        print(
            f"{method:<11} first worker ready after {starts[0][0]:.2f} s (its CPU {starts[0][1]:.2f} s);"
            f" each later one {results[method]['later_median'][0]:.2f} s (its CPU {results[method]['later_median'][1]:.2f} s),"
            f" median of {len(later)}"
        )
    if args.out:
        write_results(args.out, "worker_start", results)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
