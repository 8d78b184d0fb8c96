"""What the tracker adds to a whole run, as a user times it: ``python train.py`` with the default tracker
against the same command with ``tracker=off``, whole processes, interleaved (on, off, on, off, ...).

    python -m bench.tracker_wall [--repeats 2] [--max-ratio 1.15] [--repo DIR] [--out results.json] [OVERRIDE ...]

OVERRIDEs go to both commands; the default is the 4 layers x 8 heads x d_model 256 x d_head 32 model
for 200 steps. The tracker's share includes all it brings to a run: the snapshots, the tensor store,
the adaptive trajectory steps and the end-of-run report (a run with ``tracker=off`` draws none).
``--repo`` times another checkout's ``train.py`` (an earlier commit's) with this interpreter. W&B
offline, run directories in a temporary folder. Prints each setting's median and range, and the ratio of
the fastest runs beside that of the medians (on a shared machine one run of a command can take seconds
longer than the next). Exits 1 when the median ratio is above ``--max-ratio``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.startup import REPO, wall

SHAPE = ["model.n_layers=4", "model.n_heads=8", "model.d_model=256", "model.d_head=32", "trainer.max_steps=200"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-ratio", type=float, default=1.15)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py is timed")
    parser.add_argument("--out", type=Path)
    parser.add_argument("overrides", nargs="*", help=f"train.py overrides (default: {' '.join(SHAPE)})")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    overrides = args.overrides or SHAPE
    on, off = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for setting, walls in (([], on), (["tracker=off"], off)):
                run_dir = f"{scratch}/{len(on) + len(off)}"
                command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides, *setting]
                walls.append(wall([*command, "trainer.enable_progress_bar=false"], args.repo))
                print(f"repeat {repeat}: tracker {'off' if setting else 'on '} {walls[-1]:.1f} s", flush=True)
    ratio = statistics.median(on) / statistics.median(off)
    fastest = min(on) / min(off)  # each command's least-disturbed run: a second reading of the same ratio
    print(
        f"\ntracker on {statistics.median(on):.1f} s ({min(on):.1f}-{max(on):.1f}),"
        f" off {statistics.median(off):.1f} s ({min(off):.1f}-{max(off):.1f}) (medians of {args.repeats}, range)"
    )
    print(f"wall ratio {ratio:.3f} (target <= {args.max_ratio}): {'met' if ratio <= args.max_ratio else 'NOT met'}")
    print(f"  fastest against fastest: {fastest:.3f}")
    if args.out:
        results = {"overrides": overrides, "on_s": on, "off_s": off, "ratio": ratio, "ratio_of_fastest": fastest}
        args.out.write_text(json.dumps(results, indent=2))
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
