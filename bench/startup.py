"""What a run costs before and after its steps: ``python train.py trainer.max_steps=1`` against
``python -c "import torch, lightning"`` (the floor any Lightning run pays), whole processes timed
alternately, best of N each; then the ten slowest imports of ``python -X importtime train.py --help``.

    python -m bench.startup [--repeats 3] [--repo DIR] [--out results.json] [OVERRIDE ...]

OVERRIDEs go to the one-step run (``logger.wandb.enabled=false``, ``experiment=elhage_2l``); ``--repo``
times another checkout's ``train.py`` (an earlier commit's) with this interpreter. Target: the
one-step run at most 2.0x the import floor. Run directories go to a temporary folder, W&B offline.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.results_file import check_out, write_results

REPO = Path(__file__).resolve().parents[1]
MAX_RATIO = 2.0
FLOOR = [sys.executable, "-c", "import torch, lightning"]


@dataclass(frozen=True)
class Timing:
    """One whole process: ``wall`` seconds; ``cpu``, the CPU seconds of it and every process it waited
    for (user + system); ``steal``, the seconds the VM's host took the machine's CPUs from it meanwhile,
    all CPUs together (``/proc/stat``; 0 off Linux or on bare metal): a run with seconds of steal was slowed by
    someone else's work."""

    wall: float
    cpu: float
    steal: float


def stolen_seconds() -> float:
    """The seconds of steal since boot, all CPUs together (``/proc/stat``'s ``cpu`` line; 0 where there is none)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def timed(command: list[str], repo: Path = REPO) -> Timing:
    """``command`` run from ``repo`` as a whole process, timed (exits non-zero: an error)."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    before, steal = os.times(), stolen_seconds()
    started = time.perf_counter()
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    after = os.times()
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} exited {result.returncode}: {result.stderr.strip()[-500:]}")
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    return Timing(seconds, cpu, stolen_seconds() - steal)


def wall(command: list[str], repo: Path = REPO) -> float:
    """Seconds ``command`` takes as a whole process, run from ``repo`` (exits non-zero: an error)."""
    return timed(command, repo).wall


def slowest_imports(repo: Path = REPO, top: int = 10) -> list[tuple[float, str]]:
    """The ``top`` imports of ``train.py --help`` with the largest cumulative time (s: a module with what
    it imports), from ``-X importtime``, at any depth."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "--help"], cwd=repo, capture_output=True, text=True
    )
    rows = []
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if match:
            rows.append((int(match.group(2)) / 1e6, len(match.group(3)), match.group(4)))
    return sorted(((seconds, name) for seconds, _, name in rows), reverse=True)[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py is timed")
    parser.add_argument("--out", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    floor, run = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats + 1):  # the first round warms the file cache and is not counted
            step = [sys.executable, "train.py", f"hydra.run.dir={scratch}/run{repeat}", "trainer.max_steps=1"]
            a, b = wall(FLOOR), wall([*step, *args.overrides], args.repo)
            if repeat:
                floor.append(a)
                run.append(b)
            print(
                f"round {repeat}{' (warm-up)' if not repeat else ''}: import torch, lightning {a:.2f} s; one step {b:.2f} s"
            )
    ratio = min(run) / min(floor)
    imports = slowest_imports(args.repo)
    print(
        f"\nbest of {args.repeats}: import torch, lightning {min(floor):.2f} s; python train.py trainer.max_steps=1 {min(run):.2f} s"
    )
    print(f"ratio {ratio:.2f} (target <= {MAX_RATIO}): {'met' if ratio <= MAX_RATIO else 'NOT met'}")
    print(f"\nslowest imports of python -X importtime train.py --help in {args.repo} (cumulative s):")
    for seconds, name in imports:
        print(f"  {seconds:6.3f}  {name}")
    if args.out:
        record = {"repo": str(args.repo), "floor_s": floor, "one_step_s": run, "ratio": ratio, "imports": imports}
        write_results(args.out, "startup", record)
    return 0 if ratio <= MAX_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
