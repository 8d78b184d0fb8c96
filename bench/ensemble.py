"""A seed sweep trained as one ensemble against the same seeds run one after another and two at a
time, as whole commands with every output written; then how an ensemble's cost grows with its size.

    python -m bench.ensemble [--members 8] [--sizes 1,8,32] [--size-steps 300] [--out DIR]
                             [--skip joblib,sizes] [OVERRIDE ...]

1. ``sequential``: ``python train.py seed=k`` for k = 0..N-1, one after another (the sum of their walls);
   ``joblib``: ``python train.py -m seed=0,..,N-1 hydra/launcher=joblib hydra.launcher.n_jobs=2``;
   ``ensemble``: ``python train.py -m seed=0,..,N-1 hydra/launcher=ensemble`` (and ``ensemble2``: with
   ``hydra.launcher.n_jobs=2``, two ensembles of N/2 at once, one thread each). The default experiment and
   tracker (OVERRIDEs are added to every command: ``trainer.precision=64-true``), W&B offline.
   Each is timed by ``/usr/bin/time -v`` (wall and peak RSS). Targets: the ensemble at least 3x faster
   than sequential and 1.5x faster than joblib.
2. Member ``k`` of the ensemble against the sequential run of seed ``k``, from their CSVs: the largest
   relative difference of ``train/loss`` and ``loss/repeated`` before the single run's phase-change
   onset and at every step, the onset / midpoint / end of both, the final repeated-token loss.
3. Ensembles of each size in ``--sizes`` at ``--size-steps`` steps (and one single run at that
   length): wall, peak RSS and the training cost per member-step the ensemble reports.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ONSET, MIDPOINT, END = (f"phase_change/loss_{part}_step" for part in ("onset", "midpoint", "end"))


def timed(command: list[str], log: Path) -> dict:
    """Run ``command`` under ``/usr/bin/time -v`` from the repository; its wall (s), peak RSS (GB), exit code."""
    with open(log, "w") as out:
        code = subprocess.run(
            ["/usr/bin/time", "-v", *command], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        ).returncode
    text = log.read_text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(wall.split(":"))))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 2**20
    return {"seconds": seconds, "rss_gb": rss, "code": code, "log": str(log)}


def train(*args: str) -> list[str]:
    return [sys.executable, "train.py", *args, "trainer.enable_progress_bar=false"]


def series(run_dir: Path, key: str) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as file:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(file) if row.get(key)}


def compare(single: Path, member: Path) -> dict:
    """Member against single run: relative differences before the onset and overall, the phase change, the final loss."""
    summary_single = json.loads((single / "summary.json").read_text())
    summary_member = json.loads((member / "summary.json").read_text())
    onset = summary_single.get(ONSET)
    row = {}
    for key in ("train/loss", "loss/repeated"):
        a, b = series(member, key), series(single, key)
        rel = {s: abs(a[s] - b[s]) / abs(b[s]) for s in b if s in a}
        row[f"{key} max rel"] = max(rel.values())
        row[f"{key} max rel before onset"] = max((v for s, v in rel.items() if onset is None or s < onset), default=0.0)
    for name, key in (("onset", ONSET), ("midpoint", MIDPOINT), ("end", END)):
        row[name] = (summary_single.get(key), summary_member.get(key))
    final = max(series(single, "loss/repeated"))
    a, b = series(member, "loss/repeated")[final], series(single, "loss/repeated")[final]
    row["final loss/repeated"] = (b, a)
    row["final rel"] = abs(a - b) / abs(b)
    return row


def step_pair(pair: tuple) -> str:
    """``single / member`` steps, to a tenth of a step (``-`` where there is none)."""
    return " / ".join("-" if v is None else f"{v:.1f}" for v in pair)


def member_step_ms(log: Path) -> float | None:
    found = re.search(r"([\d.]+) ms a member-step", Path(log).read_text())
    return float(found.group(1)) if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--sizes", default="1,8,32")
    parser.add_argument("--size-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None, help="where every run goes (default: a temporary directory)")
    parser.add_argument("--skip", default="", help="comma-separated: sequential, joblib, ensemble, ensemble2, sizes")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-ensemble-"))
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    n, extra = args.members, list(args.overrides)
    seeds = ",".join(map(str, range(n)))
    print(f"bench.ensemble: {n} seeds of the default experiment {' '.join(extra)} into {out}", flush=True)

    results = {}
    if "sequential" not in skip:
        walls = []
        for k in range(n):
            command = train(f"seed={k}", f"hydra.run.dir={out}/sequential/{k}", *extra)
            walls.append(timed(command, out / f"sequential_{k}.log"))
            print(f"  sequential seed {k}: {walls[-1]['seconds']:.1f} s, {walls[-1]['rss_gb']:.2f} GB", flush=True)
        results["sequential"] = {
            "seconds": sum(w["seconds"] for w in walls),
            "rss_gb": max(w["rss_gb"] for w in walls),
            "code": max(w["code"] for w in walls),
        }
    if "joblib" not in skip:
        command = train(
            "-m",
            f"seed={seeds}",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            f"hydra.sweep.dir={out}/joblib",
            *extra,
        )
        results["joblib"] = timed(command, out / "joblib.log")
        print(f"  joblib, 2 at a time: {results['joblib']['seconds']:.1f} s", flush=True)
    if "ensemble" not in skip:
        command = train("-m", f"seed={seeds}", "hydra/launcher=ensemble", f"hydra.sweep.dir={out}/ensemble", *extra)
        results["ensemble"] = timed(command, out / "ensemble.log")
        print(f"  ensemble: {results['ensemble']['seconds']:.1f} s", flush=True)
    if "ensemble2" not in skip:
        command = train(
            "-m",
            f"seed={seeds}",
            "hydra/launcher=ensemble",
            "hydra.launcher.n_jobs=2",
            f"hydra.sweep.dir={out}/ensemble2",
            *extra,
        )
        results["ensemble, n_jobs=2"] = timed(command, out / "ensemble2.log")
        print(f"  ensemble in 2 processes: {results['ensemble, n_jobs=2']['seconds']:.1f} s", flush=True)

    ensembles = [how for how in ("ensemble", "ensemble, n_jobs=2") if how in results]
    if ensembles:
        print(f"\n{n} seeds, whole commands (every output written), /usr/bin/time -v:")
        print(f"{'how':<24} {'wall s':>8} {'peak RSS GB':>12} {'exit':>5}")
        for how, r in results.items():
            print(f"{how:<24} {r['seconds']:>8.1f} {r['rss_gb']:>12.2f} {r['code']:>5}")
        print(f"ensemble per member-step (training alone): {member_step_ms(out / 'ensemble.log')} ms")
        targets = {"sequential": 3.0, "joblib": 1.5}
        for how in ensembles:
            seconds = results[how]["seconds"]
            print(
                f"{how}:",
                "; ".join(
                    f"{results[base]['seconds'] / seconds:.2f}x {base} (target {t}x: {results[base]['seconds'] / seconds >= t})"
                    for base, t in targets.items()
                    if base in results
                ),
            )
    if "ensemble" in results and "sequential" in results:
        print("\nmember k against the single run of seed k (relative differences; steps single / member):")
        rows = []
        for k in range(n):
            row = compare(out / "sequential" / str(k), out / "ensemble" / str(k))
            rows.append(row)
            print(
                f"  seed {k}: train/loss {row['train/loss max rel before onset']:.1e} before onset"
                f" ({row['train/loss max rel']:.1e} overall), loss/repeated {row['loss/repeated max rel before onset']:.1e}"
                f" ({row['loss/repeated max rel']:.1e}); onset {step_pair(row['onset'])}, midpoint {step_pair(row['midpoint'])},"
                f" end {step_pair(row['end'])};"
                f" final {row['final loss/repeated'][0]:.4f} / {row['final loss/repeated'][1]:.4f} ({100 * row['final rel']:.2f} %)"
            )
        results["comparison"] = rows

    if "sizes" not in skip:
        steps = args.size_steps
        print(f"\nensemble size at {steps} steps (whole command; training per member-step as the ensemble reports it):")
        single = timed(
            train(f"trainer.max_steps={steps}", f"hydra.run.dir={out}/size_single", *extra), out / "size_single.log"
        )
        print(f"  single run: {single['seconds']:.1f} s, {single['rss_gb']:.2f} GB", flush=True)
        results["sizes"] = {"single": single}
        for size in map(int, args.sizes.split(",")):
            r = timed(
                train(
                    "-m",
                    f"seed=range(0,{size})",
                    "hydra/launcher=ensemble",
                    f"trainer.max_steps={steps}",
                    f"hydra.sweep.dir={out}/size_{size}",
                    *extra,
                ),
                out / f"size_{size}.log",
            )
            r["member_step_ms"] = member_step_ms(out / f"size_{size}.log")
            results["sizes"][size] = r
            print(
                f"  {size:>3} members: {r['seconds']:.1f} s ({r['seconds'] / size:.1f} s a member), {r['rss_gb']:.2f} GB"
                f" ({r['rss_gb'] / single['rss_gb']:.1f}x one run), {r['member_step_ms']} ms a member-step, exit {r['code']}",
                flush=True,
            )
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nresults: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
