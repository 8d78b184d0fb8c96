"""What the tracker adds to a whole run, as a user times it: ``python train.py`` with the default tracker
against the same command with ``tracker=off``, whole processes, interleaved (on, off, on, off, ...).

    python -m bench.tracker_wall [--repeats 2] [--max-ratio 1.15] [--repo DIR] [--out results.json] [OVERRIDE ...]

OVERRIDEs go to both commands; the default is the 4 layers x 8 heads x d_model 256 x d_head 32 model
for 200 steps. The tracker's share includes all it brings to a run: the snapshots, the tensor store,
the adaptive trajectory steps and the end-of-run report (a run with ``tracker=off`` draws none).
``--repo`` times another checkout's ``train.py`` (an earlier commit's) with this interpreter. W&B
offline, run directories in a temporary folder. Prints each setting's median and range, and the ratio of
the fastest runs beside that of the medians (on a shared machine one run of a command can take seconds
longer than the next). Beside each run, its CPU seconds (the process and those it waited for) and the
seconds the VM's host stole from the machine meanwhile (``/proc/stat``): a run with seconds of steal was
slowed by someone else's work, and the CPU ratio of the medians is the steadier second reading. Exits 1
when the median wall ratio is above ``--max-ratio``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.results_file import check_out, write_results
from bench.startup import REPO, Timing, timed

SHAPE = ["model.n_layers=4", "model.n_heads=8", "model.d_model=256", "model.d_head=32", "trainer.max_steps=200"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-ratio", type=float, default=1.15)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py is timed")
    parser.add_argument("--out", type=Path)
    parser.add_argument("overrides", nargs="*", help=f"train.py overrides (default: {' '.join(SHAPE)})")
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    overrides = args.overrides or SHAPE
    on: list[Timing] = []
    off: list[Timing] = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for setting, runs in (([], on), (["tracker=off"], off)):
                run_dir = f"{scratch}/{len(on) + len(off)}"
                command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides, *setting]
                runs.append(timed([*command, "trainer.enable_progress_bar=false"], args.repo))
                t = runs[-1]
                print(
                    f"repeat {repeat}: tracker {'off' if setting else 'on '} {t.wall:.1f} s"
                    f" (CPU {t.cpu:.1f} s, steal {t.steal:.1f} s)",
                    flush=True,
                )
    median = lambda runs, field: statistics.median(getattr(t, field) for t in runs)
    ratio = median(on, "wall") / median(off, "wall")
    fastest = min(t.wall for t in on) / min(t.wall for t in off)  # each command's least-disturbed run
    cpu_ratio = median(on, "cpu") / median(off, "cpu")
    span = lambda runs: f"{min(t.wall for t in runs):.1f}-{max(t.wall for t in runs):.1f}"
    print(
        f"\ntracker on {median(on, 'wall'):.1f} s ({span(on)}), off {median(off, 'wall'):.1f} s ({span(off)})"
        f" (medians of {args.repeats}, range)"
    )
    print(f"wall ratio {ratio:.3f} (target <= {args.max_ratio}): {'met' if ratio <= args.max_ratio else 'NOT met'}")
    print(f"  fastest against fastest: {fastest:.3f}")
    print(
        f"  CPU: on {median(on, 'cpu'):.1f} s, off {median(off, 'cpu'):.1f} s: {cpu_ratio:.3f};"
        f" steal over all runs {sum(t.steal for t in on + off):.1f} s"
    )
    if args.out:
        results = {
            "overrides": overrides,
            "on": [vars(t) for t in on],
            "off": [vars(t) for t in off],
            "ratio": ratio,
            "ratio_of_fastest": fastest,
            "cpu_ratio": cpu_ratio,
        }
        write_results(args.out, "tracker_wall", results)
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
