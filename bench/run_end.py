"""What the end of a tracked run costs: from the tracker's last snapshot (training over) to the process's
exit, that is the end-of-run report, W&B's finishing, the explorer page and the interpreter's exit. This
checkout and another (``--repo``, an earlier commit's) alternately, whole ``python train.py`` processes
with this interpreter.

    python -m bench.run_end [--repeats 3] [--repo DIR] [--out results.json] [OVERRIDE ...]

OVERRIDEs go to every run (default: the 4 layers x 8 heads x d_model 256 x d_head 32 model for 200 steps,
as ``bench.tracker_wall``). The end is timed from the tracker's totals line (``tracker: N snapshots in
...``, printed right after its last snapshot), as it arrives on the unbuffered pipe, to the process's
exit: nothing of the run is patched, so any commit whose tracker prints that line can be timed. W&B
offline, run directories in a temporary folder. Prints each run's end, the steal of the VM's host
meanwhile (``bench.startup.stolen_seconds``), and each checkout's median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results_file import check_out, write_results
from bench.startup import REPO, stolen_seconds
from bench.tracker_wall import SHAPE

TRACKER_DONE = "tracker: "  # the tracker's totals line: "tracker: 21 snapshots in 3.2 s (...)"


def end_of_run(repo: Path, overrides: list[str], run_dir: str) -> float:
    """Seconds from ``repo``'s tracker's last snapshot to its ``train.py`` process's exit."""
    command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    done, tail = None, []
    with subprocess.Popen(
        command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        for line in process.stdout:
            if done is None and line.startswith(TRACKER_DONE) and " snapshots in " in line:
                done = time.perf_counter()
            tail = [*tail[-20:], line]
    exited = time.perf_counter()
    if process.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} in {repo} exited {process.returncode}: {''.join(tail)[-800:]}")
    if done is None:
        raise SystemExit(
            f"error: {repo}'s run printed no tracker totals line: is its tracker on (and its cost report)?"
        )
    return exited - done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repo", type=Path, help="another checkout, timed alternately with this one")
    parser.add_argument("--out", type=Path)
    parser.add_argument("overrides", nargs="*", help=f"train.py overrides (default: {' '.join(SHAPE)})")
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.repo is not None and not (args.repo / "train.py").is_file():
        parser.error(f"--repo {args.repo}: no train.py there")
    overrides = [*(args.overrides or SHAPE), "trainer.enable_progress_bar=false"]
    repos = [REPO, *([args.repo.resolve()] if args.repo else [])]
    ends: dict[str, list[float]] = {str(repo): [] for repo in repos}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for index, repo in enumerate(repos):
                steal = stolen_seconds()
                seconds = end_of_run(repo, overrides, f"{scratch}/{repeat}-{index}")
                ends[str(repo)].append(seconds)
                print(f"repeat {repeat}: {repo}: {seconds:.2f} s (steal {stolen_seconds() - steal:.1f} s)", flush=True)
    for repo, seconds in ends.items():
        print(f"{repo}: median {statistics.median(seconds):.2f} s ({min(seconds):.2f}-{max(seconds):.2f})")
    if args.out:
        write_results(args.out, "run_end", {"overrides": overrides, "seconds": ends})
    return 0


if __name__ == "__main__":
    sys.exit(main())
