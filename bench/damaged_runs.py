"""Every command that reads a run, against a damaged copy of it: each of the run's JSON, CSV, YAML,
safetensors and tensor-store files cut to half its length in turn (one file of each kind in a folder of
many: the tensor store's and the trajectory's), and each command's ``--out`` onto a file of the run it did
not write. For each: the exit code, the last line it printed on stderr, whether it printed a traceback,
and whether every file of the run is byte for byte what it was (a command's own outputs aside: the run
report's summary and figures, a re-scoring's ``analysis/``).

    python -m bench.damaged_runs RUN_DIR [--commands run_report,sweep_report,...]

``RUN_DIR``: a finished run with a weight trajectory and a tensor store (the tests' tiny run:
``python train.py trainer.max_steps=60 trajectory.log_steps=4 trajectory.every_n_steps=30 ...``). Each
command runs as a user runs it, ``python -m ...`` in a subprocess, on a fresh copy.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMANDS = {  # name: (arguments, with RUN the damaged run and SWEEP the folder holding it; its own outputs)
    "run_report": (["reports.run_report", "RUN"], ("summary.json", ".png", "validity.csv")),
    "sweep_report": (["reports.sweep_report", "SWEEP"], ()),
    "emergence": (["reports.emergence", "SWEEP", "--resamples", "100"], ()),
    "explorer": (["analysis.explorer", "RUN"], ("explorer.html",)),
    "pair_curves": (["reports.pair_curves", "RUN"], ("pair_curves.png",)),
    "forecast_fit": (["analysis.forecast", "fit", "SWEEP"], ()),
    "rescore": (["analysis.rescore", "RUN", "--name", "damaged", "--steps", "30,60"], ("analysis",)),
    "export": (["analysis.export", "RUN", "--step", "60", "--out", "OUT"], ()),
}
OUT_ONTO = {  # name: the --out that names a file of the run it did not write
    "explorer": ["analysis.explorer", "RUN", "--out", "RUN/summary.json"],
    "pair_curves": ["reports.pair_curves", "RUN", "--out", "RUN/summary.json"],
    "forecast_fit": ["analysis.forecast", "fit", "SWEEP", "--out", "RUN/summary.json"],
    "emergence": ["reports.emergence", "SWEEP", "--out", "RUN/summary.json"],
    "export": ["analysis.export", "RUN", "--step", "60", "--out", "RUN/summary.json"],
}


def damaged_files(run: Path) -> list[Path]:
    """One file of each kind: every file outside the tensor store and the trajectory, and the last of each
    suffix inside them (the trajectory's final step; their index too)."""
    chosen: dict[tuple, Path] = {}
    for path in sorted(run.rglob("*")):
        if not path.is_file() or "wandb" in path.parts or path.suffix in (".log", ".png", ".html"):
            continue
        relative = path.relative_to(run)
        many = relative.parts[0] in ("tensors", "trajectory") and path.name != "index.json"
        chosen[(relative.parts[0], path.suffix) if many else (str(relative),)] = path  # the last (the final step's)
    return [p.relative_to(run) for p in chosen.values()]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def run_command(arguments: list[str], sweep: Path, run: Path, out: Path) -> subprocess.CompletedProcess:
    words = [a.replace("RUN", str(run)).replace("SWEEP", str(sweep)).replace("OUT", str(out)) for a in arguments]
    return subprocess.run([sys.executable, "-m", *words], cwd=REPO, capture_output=True, text=True, timeout=600)


def row(name: str, what: str, arguments: list[str], own: tuple, source: Path, damage: Path | None) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        sweep = Path(scratch) / "sweep"
        run = sweep / "0"
        shutil.copytree(source, run, symlinks=True, ignore=shutil.ignore_patterns("wandb", "analysis"))
        if damage is not None:
            target = run / damage
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        before = digest(run)
        result = run_command(arguments, sweep, run, Path(scratch) / "out")
        after = digest(run)
        changed = [k for k, v in before.items() if after.get(k) != v and not any(o in k for o in own)]
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        said = lines[-1].replace(str(run), "RUN").replace(str(sweep), "SWEEP")[:110] if lines else ""
        traceback = "yes" if "Traceback (most recent call last)" in result.stderr else "no"
        kept = "yes" if not changed else f"NO: {', '.join(changed[:2])}"
        return f"| {name} | {what} | {result.returncode} | {traceback} | {kept} | {said.replace('|', '/')} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.damaged_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated, of: " + ", ".join(COMMANDS))
    args = parser.parse_args(argv)
    names = args.commands.split(",")
    print("| command | file cut in half (or --out) | exit | traceback | run's files kept | last line on stderr |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        arguments, own = COMMANDS[name]
        for damage in damaged_files(args.run_dir):
            print(row(name, str(damage), arguments, own, args.run_dir, damage), flush=True)
        if name in OUT_ONTO:
            print(row(name, "--out RUN/summary.json", OUT_ONTO[name], (), args.run_dir, None), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
