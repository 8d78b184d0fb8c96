"""The GPU checks in one command, for a lent machine with a fixed budget: the ensemble's members per
second by size, the tracker's overhead at the default shape, an ensemble's measuring cost with the
default tracker, and one snapshot's cost and error (``bench.cuda``).

    python -m bench.device [--out DIR] [--budget 380] [--sizes 1,8,64,256] [--size-steps 300]
                           [--overhead-steps 1500] [--overhead-repeats 3] [--tracked 32] [--skip PART,..] [--cpu]

(``bash bench/gpu.sh`` installs the wheels of ``.whl/`` first, sets the environment and runs this.)
Parts, in this order, each in a process of its own under a time limit (a part that runs out is
stopped (SIGTERM, then SIGKILL) and what it had printed is still read; a part that would start with under 20 s left is skipped):

``gemm``      nvidia-smi, torch and CUDA versions, and a square matmul's rate in float32, TF32 and bfloat16.
``size_N``    ``python train.py -m seed=range(0,N) hydra/launcher=ensemble trainer=gpu tracker=off
              trajectory.enabled=false logger=csv trainer.max_steps=STEPS``: training alone. From the
              ensemble's cost line: set-up, the fit, the training time and its ms a member-step (the
              ensemble's own timer, from a step's start to its end, before the divergence check's host sync:
              on a GPU it can leave out device time the host did not wait for); from its
              progress lines, the steady wall ms a step (every interval after the first: the data, the
              host sync of the divergence check and each member's bookkeeping included); the whole
              command's wall and peak RSS. Members per second = member-steps per second.
``overhead``  the default shape's tracker overhead on the GPU: ``bench.throughput``'s Lightning runs
              without and with the tracker (default settings, no logger), interleaved, medians; the
              steady state from the tracker's ledger, as ``bench.throughput`` reads it (its bare loop is
              left out: it trains on the CPU). Steps are cut to fit the part's time (≥ 300).
``tracked``   ``--tracked`` members (32) with the default tracker and trajectory (W&B off), the same
              length: the members' own callbacks, by callback, from the cost line.
``cuda``      ``python -m bench.cuda``: every tracked quantity of one snapshot against the CPU's float64,
              and a snapshot's time on each.

Writes ``DIR/device.log`` (every part's whole output), ``DIR/device.json`` (the results) and
``DIR/cuda.json`` (``bench.cuda``'s own); prints one table at the end. ``--cpu``: the CPU in the GPU's
place (``trainer=cpu``, ``bench.cuda --dry-run``), to check the script with tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results_file import MARK, write_results
from records.outputs import foreign_out

REPO = Path(__file__).resolve().parents[1]
PARTS = ("gemm", "sizes", "overhead", "tracked", "cuda")
MIN_PART_S = 20  # a part is not started with less left
LOG_CAP = 2_000_000  # characters of one part's output kept in device.log (head and tail)

# caps in seconds: on an H100/H200 the default shape trains at ~10 ms a step; start-up is ~10-15 s a command
CAP_GEMM = 60
CAP_SIZE = {1: 60, 8: 60, 64: 100, 256: 160}
CAP_SIZE_OTHER = 120
CAP_OVERHEAD = 140
CAP_TRACKED = 120  # 32 end-of-run figures: ~1-3 s each on a CPU core
CAP_CUDA = 90

SET_UP = re.compile(r"ensemble of (\d+) members \(jobs [^)]*\) set up in ([\d.]+) s")
COST = re.compile(
    r"ensemble: (\d+) members in ([\d.]+) s: training ([\d.]+) s \(([\d.]+) ms a step for all, ([\d.]+) ms a member-step\),"
    r" the members' own callbacks ([\d.]+) s \(([\d.]+) s a member(?:; ([^)]*))?\)"
)
PROGRESS = re.compile(r"^step (\d+)/(\d+)  loss .* over (\d+) members  \(([\d.]+) ms/step\)", re.M)


def python() -> list[str]:
    """This interpreter, with ``-S`` if it runs without site (a check of the device's imports here)."""
    return [sys.executable, *(["-S"] if sys.flags.no_site else [])]


class Runner:
    """Runs the parts one after another, each in its own process group under a limit that also keeps
    to the whole run's deadline; appends each part's output to the log."""

    def __init__(self, out: Path, budget: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget
        self.log = out / "device.log"
        self.parts: dict[str, dict] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def limit(self, cap: float) -> float | None:
        """The part's limit: its cap, or what is left of the budget; None: too little left to start."""
        left = self.left()
        return None if left < MIN_PART_S else min(cap, left)

    def skipped(self, name: str, why: str) -> dict:
        self.parts[name] = {"status": "skipped", "why": why, "seconds": 0.0}
        print(f"[{name}] skipped: {why}", flush=True)
        return self.parts[name]

    def run(self, name: str, command: list[str], cap: float, env: dict | None = None) -> dict | None:
        """Run ``command`` from the repository; its output, wall, peak RSS, exit code and whether it ran out."""
        limit = self.limit(cap)
        if limit is None:
            self.skipped(name, f"{max(0.0, self.left()):.0f} s left of the budget")
            return None
        print(f"[{name}] {' '.join(command)}  (limit {limit:.0f} s)", flush=True)
        with tempfile.TemporaryFile("w+", errors="replace") as output:
            started = time.monotonic()
            process = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: a timeout ends it and its children only
            )
            timed_out = False
            while True:
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() - started > limit:
                    timed_out = True
                    status, usage = self.stop(process.pid)
                    break
                time.sleep(0.2)
            process.returncode = 0  # reaped above by wait4: keep Popen from waiting again
            seconds = time.monotonic() - started
            output.seek(0)
            text = output.read()
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        rss_gb = usage.ru_maxrss / 2**20 if usage is not None else None
        kept = text if len(text) <= LOG_CAP else text[: LOG_CAP // 2] + "\n[... cut ...]\n" + text[-LOG_CAP // 2 :]
        with open(self.log, "a") as log:
            log.write(f"\n===== [{name}] {' '.join(command)}\n")
            log.write(kept)
            log.write(
                f"\n===== [{name}] exit {code}, {seconds:.1f} s{' (ran out of time: killed)' if timed_out else ''}\n"
            )
        result = {
            "status": "timeout" if timed_out else ("ok" if code == 0 else "failed"),
            "seconds": seconds,
            "code": code,
            "rss_gb": rss_gb,
            "limit_s": limit,
            "command": command,
        }
        self.parts[name] = result
        tail = text.strip().splitlines()[-1:] if result["status"] != "ok" else []
        print(f"[{name}] {result['status']} in {seconds:.1f} s{': ' + tail[0] if tail else ''}", flush=True)
        return {**result, "text": text}

    @staticmethod
    def stop(pid: int) -> tuple[int | None, object]:
        """End the part's process group: a stop signal first (a run checkpoints and ends), then a kill;
        its wait status and resource use, or None where it could not be reaped."""
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
            end = time.monotonic() + grace
            while time.monotonic() < end:
                found, status, usage = os.wait4(pid, os.WNOHANG)
                if found:
                    return status, usage
                time.sleep(0.1)
        return None, None


# ---- the parts run in their own processes ------------------------------------------------------


def gemm_part(cpu: bool, out: Path) -> None:
    """Versions, the device, and a square matmul's rate in float32 (IEEE), TF32 and bfloat16."""
    import torch

    device = "cpu" if cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA device visible to torch")
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError as error:
        info["lightning"] = f"not importable: {error}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {"capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / 2**30}
        info["sms"] = props.multi_processor_count
    n, repeats = (8192, 20) if device == "cuda" else (1024, 3)
    rates = {}
    for label, dtype, tf32 in (
        ("float32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("bfloat16", torch.bfloat16, False),
    ):
        if device == "cpu" and label == "tf32":
            continue
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        sync()
        rates[label] = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
        print(f"matmul {n} x {n} {label}: {rates[label]:.1f} TFLOP/s", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    info["matmul_n"] = n
    info["matmul_tflops"] = rates
    print(json.dumps(info, indent=1), flush=True)
    (out / "gemm.json").write_text(json.dumps(info))


def overhead_part(cpu: bool, steps: int, repeats: int, limit: float, out: Path, overrides: list[str]) -> None:
    """Lightning without and with the tracker at the default shape, interleaved (``bench.throughput``'s
    runs); the steps cut so that the repeats fit ``limit`` seconds; the results saved after each repeat."""
    import lightning as L
    import torch

    from bench import throughput as tp

    tp.quiet_lightning()
    started = time.perf_counter()
    trainer = ["trainer=cpu"] if cpu else ["trainer=gpu"]
    setups = ("lightning", "lightning+tracker")
    # untimed for the result: one round pays the first-call costs; two more lengths size the runs
    warm = {}
    for length in (tp.WARMUP_ROUND_STEPS, tp.WARMUP_ROUND_STEPS, 4 * tp.WARMUP_ROUND_STEPS):
        warm_cfg = tp.compose_config(length, [*trainer, *overrides])
        for name in setups:
            warm[name, length] = tp.run_setup(name, warm_cfg, length)[0]
    short, long = tp.WARMUP_ROUND_STEPS, 4 * tp.WARMUP_ROUND_STEPS
    step_s = {name: max(warm[name, long] - warm[name, short], 0) / (long - short) for name in setups}
    per_step = sum(step_s.values())
    per_fit = sum(max(warm[name, short] - short * step_s[name], 0) for name in setups)
    print(f"sizing: {1000 * per_step:.2f} ms a step of both setups, {per_fit:.2f} s of fit overhead", flush=True)
    left = limit - (time.perf_counter() - started) - 10
    fits = int((left / max(repeats, 1) - per_fit) / max(per_step, 1e-6)) // 100 * 100
    if fits < steps and not cpu:
        print(f"{steps} steps x {repeats} would not fit the {limit:.0f} s limit: {max(fits, 300)} steps", flush=True)
        steps = max(fits, 300)
    cfg = tp.compose_config(steps, [*trainer, *overrides])
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    ledgers = []
    last_tracker = None
    for repeat in range(repeats):
        for name in setups:
            elapsed, tracker = tp.run_setup(name, cfg, steps)
            seconds[name].append(elapsed)
            if tracker is not None:
                ledgers.append(tracker.cost.ledger)
                last_tracker = tracker
        median_s = {name: statistics.median(s) for name, s in seconds.items()}
        overhead = 1 - median_s["lightning"] / median_s["lightning+tracker"]
        parts = sorted({p for ledger in ledgers for p in ledger.seconds})
        part_ms = {
            p: statistics.median(1000 * lg.seconds.get(p, 0) / max(lg.runs.get(p, 1), 1) for lg in ledgers)
            for p in parts
        }
        amortised = last_tracker.cost.amortised_seconds_per_step({p: ms / 1000 for p, ms in part_ms.items()})
        steady = sum(amortised.values()) / (median_s["lightning"] / steps)
        result = {
            "device": torch.cuda.get_device_name() if not cpu else "cpu (dry run)",
            "torch": torch.__version__,
            "lightning": L.__version__,
            "trainer": trainer[0],
            "overrides": overrides,
            "steps": steps,
            "repeats_done": repeat + 1,
            "tokens_per_step": tokens_per_step,
            "seconds": seconds,
            "ms_per_step": {name: 1000 * s / steps for name, s in median_s.items()},
            "tokens_per_s": {name: steps * tokens_per_step / s for name, s in median_s.items()},
            "tracker_overhead": overhead,
            "tracker_overhead_steady_state": steady,
            "target": tp.MAX_TRACKER_OVERHEAD,
            "tracker_part_ms": part_ms,
            "tracker_part_runs": {p: ledgers[-1].runs.get(p, 0) for p in parts},
            "tracker_measures": list(cfg.tracker.measures),
        }
        (out / "overhead.json").write_text(json.dumps(result))
        print(
            f"repeat {repeat + 1}: off {seconds['lightning'][-1]:.2f} s, on {seconds['lightning+tracker'][-1]:.2f} s;"
            f" median overhead {overhead:.1%}, steady state {steady:.1%}",
            flush=True,
        )
    print(
        "tracker parts (ms each, runs): "
        + ", ".join(f"{p} {part_ms[p]:.2f} ({result['tracker_part_runs'][p]})" for p in parts)
    )


# ---- reading the parts' outputs ----------------------------------------------------------------


def read_ensemble(text: str, n: int) -> dict:
    """The ensemble's set-up, cost line and progress lines, as numbers (what was printed before any kill)."""
    found: dict = {}
    if m := SET_UP.search(text):
        found["set_up_s"] = float(m.group(2))
    if m := COST.search(text):
        found |= {
            "fit_s": float(m.group(2)),
            "training_s": float(m.group(3)),
            "step_ms": float(m.group(4)),
            "member_step_ms": float(m.group(5)),
            "callbacks_s": float(m.group(6)),
            "callbacks_s_a_member": float(m.group(7)),
            "callbacks": {
                name: float(s) for name, s in (p.rsplit(" ", 1) for p in (m.group(8) or "").split(", ") if p.strip())
            },
        }
        found["members_per_s_training"] = 1000 / found["member_step_ms"] if found["member_step_ms"] > 0 else None
    progress = [(int(step), float(ms)) for step, _, _, ms in PROGRESS.findall(text)]
    if progress:
        found["progress"] = progress
        steady = [ms for _, ms in progress[1:]] or [progress[0][1]]  # the first interval holds the warm-up
        found["steady_step_ms"] = statistics.median(steady)
        found["steady_from_step"] = progress[0][0] if len(progress) > 1 else 0
        found["members_per_s_wall"] = n * 1000 / found["steady_step_ms"]
    return found


def ensemble_command(n: int, steps: int, cpu: bool, sweep_dir: Path, tracked: bool, extra: list[str]) -> list[str]:
    off = [] if tracked else ["tracker=off", "trajectory.enabled=false"]
    return [
        *python(),
        "train.py",
        "-m",
        f"seed=range(0,{n})",
        "hydra/launcher=ensemble",
        "trainer=cpu" if cpu else "trainer=gpu",
        f"trainer.max_steps={steps}",
        "trainer.enable_progress_bar=true",
        f"trainer.progress_every_n_steps={max(1, steps // 6)}",
        *off,
        "logger=csv",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]


# ---- the table ---------------------------------------------------------------------------------


def fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(results: dict) -> str:
    lines = []
    g = results.get("gemm") or {}
    rates = g.get("matmul_tflops", {})
    if "nvidia_smi" in results:
        lines.append(f"nvidia-smi: {results['nvidia_smi']}")
    lines.append(
        f"device: {g.get('device', '?')}; torch {g.get('torch', '?')} (CUDA {g.get('cuda')}), lightning {g.get('lightning', '?')},"
        f" python {g.get('python', '?')}, {g.get('cpu_count', '?')} CPUs"
    )
    if rates:
        lines.append(
            f"matmul {g.get('matmul_n')}^2: "
            + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in rates.items())
            + " (TFLOP/s = 1e12 FLOP/s)"
        )
    sizes = results.get("sizes", {})
    if sizes:
        steps = results["settings"]["size_steps"]
        lines.append(
            f"\nensembles, {steps} steps, training alone (tracker=off trajectory.enabled=false logger=csv):"
            "\n  train ms a member-step: the cost line (the ensemble's timer); steady: wall ms a step from the progress lines"
        )
        head = (
            f"  {'N':>4} {'status':>8} {'wall s':>7} {'set-up s':>8} {'fit s':>6} {'ms/step':>8} {'ms/member-step':>14}"
            f" {'members/s':>10} {'steady ms/step':>14} {'members/s':>10} {'RSS GB':>7}"
        )
        lines.append(head)
        lines.append(
            f"  {'':>4} {'':>8} {'':>7} {'':>8} {'':>6} {'(train)':>8} {'(train)':>14} {'(train)':>10} {'(wall)':>14} {'(wall)':>10}"
        )
        for n, r in sizes.items():
            lines.append(
                f"  {n:>4} {r.get('status', '?'):>8} {fmt(r.get('seconds')):>7} {fmt(r.get('set_up_s')):>8}"
                f" {fmt(r.get('fit_s')):>6} {fmt(r.get('step_ms'), '.2f'):>8} {fmt(r.get('member_step_ms'), '.3f'):>14}"
                f" {fmt(r.get('members_per_s_training'), ',.0f'):>10} {fmt(r.get('steady_step_ms'), '.2f'):>14}"
                f" {fmt(r.get('members_per_s_wall'), ',.0f'):>10} {fmt(r.get('rss_gb'), '.2f'):>7}"
            )
    o = results.get("overhead")
    if o and "ms_per_step" in o:
        ms = o["ms_per_step"]
        met = "met" if o["tracker_overhead_steady_state"] <= o["target"] else "NOT met"
        lines.append(
            f"\ntracker overhead, default shape, {o['trainer']}, {o['steps']} steps x {o['repeats_done']} interleaved (medians):"
            f"\n  Lightning {ms['lightning']:.2f} ms/step ({o['tokens_per_s']['lightning']:,.0f} tokens/s), with the tracker"
            f" {ms['lightning+tracker']:.2f} ms/step ({o['tokens_per_s']['lightning+tracker']:,.0f} tokens/s)"
            f"\n  overhead end to end {o['tracker_overhead']:.1%}; steady state (ledger) {o['tracker_overhead_steady_state']:.1%}"
            f" (target <= {o['target']:.0%}: {met})"
            f"\n  parts, ms each: " + ", ".join(f"{p} {v:.2f}" for p, v in o["tracker_part_ms"].items())
        )
    elif "overhead" in results.get("parts", {}):
        lines.append(f"\ntracker overhead: {results['parts']['overhead']['status']}, no result")
    t = results.get("tracked")
    if t:
        lines.append(
            f"\nensemble of {t['n']} with the default tracker and trajectory ({t.get('status')}): wall {fmt(t.get('seconds'))} s,"
            f" training {fmt(t.get('member_step_ms'), '.3f')} ms a member-step, steady {fmt(t.get('steady_step_ms'), '.2f')} ms a step;"
            f" members' callbacks {fmt(t.get('callbacks_s'))} s ({fmt(t.get('callbacks_s_a_member'), '.2f')} s a member: "
            + ", ".join(f"{k} {v:.1f}" for k, v in (t.get("callbacks") or {}).items())
            + ")"
        )
    c = results.get("cuda")
    if c and "snapshot_seconds" in c:
        s = c["snapshot_seconds"]
        errors = {k: v.get("cuda float32") for k, v in c.get("relative_error_against_cpu_float64", {}).items()}
        worst = max(((v, k) for k, v in errors.items() if v is not None and v == v), default=(None, "-"))
        lines.append(
            "\nsnapshot, every quantity (bench.cuda, median s): "
            + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in s.items())
            + f"; largest CUDA float32 error against the CPU's float64: {fmt(worst[0], '.1e')} ({worst[1]})"
        )
    parts = results.get("parts", {})
    lines.append(
        "\nparts: "
        + ", ".join(f"{name} {p['status']} {p.get('seconds', 0):.0f} s" for name, p in parts.items())
        + f"; whole {results.get('whole_s', 0):.0f} s"
    )
    return "\n".join(lines)


def part_results(path: Path) -> dict | None:
    """The JSON results a part wrote at ``path``; None where it wrote none, or where the file is damaged (a part
    killed while writing it), which is said in one line naming it."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"bench.device: {path} is damaged ({type(error).__name__}): its results left out", flush=True)
        return None


def foreign_output(out: Path) -> str | None:
    """Why ``--out DIR`` must not be written (one line), None where it may: ``DIR`` is new, or each of
    its files this command writes is absent or a benchmark's own, by :func:`records.outputs.foreign_out`'s rule
    (``device.json`` and ``cuda.json`` carry :data:`bench.results_file.MARK`, ``device.log`` ``bench.device``)."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file: name a directory (nothing written)"
    for name, mark in (("device.json", MARK), ("cuda.json", MARK), ("device.log", "bench.device")):
        path = out / name
        if path.exists() and foreign_out(path, mark):
            what = (
                "is a directory"
                if path.is_dir()
                else "exists and bench.device did not write it: name another directory"
            )
            return f"--out {out}: {path} {what} (nothing written)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "device")
    parser.add_argument("--budget", type=float, default=380, help="seconds for every part together")
    parser.add_argument("--sizes", default="1,8,64,256")
    parser.add_argument("--size-steps", type=int, default=300)
    parser.add_argument("--overhead-steps", type=int, default=1500)
    parser.add_argument("--overhead-repeats", type=int, default=3)
    parser.add_argument("--tracked", type=int, default=32, help="members of the ensemble with the default tracker")
    parser.add_argument("--cuda-steps", type=int, default=400)
    parser.add_argument("--cuda-repeats", type=int, default=5)
    parser.add_argument("--skip", default="", help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--cpu", action="store_true", help="the CPU in the GPU's place: checks the script")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    parser.add_argument("--limit", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the overhead part (default shape: none)")
    args = parser.parse_args(argv)
    if args.part is None and (why := foreign_output(args.out)):
        raise SystemExit(f"error: {why}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "gemm":
        gemm_part(args.cpu, args.out)
        return 0
    if args.part == "overhead":
        overhead_part(args.cpu, args.overhead_steps, args.overhead_repeats, args.limit, args.out, args.overrides)
        return 0

    started = time.monotonic()
    skip = set(filter(None, args.skip.split(",")))
    if unknown := skip - set(PARTS):
        parser.error(f"unknown parts to skip: {sorted(unknown)}")
    scratch = Path(tempfile.mkdtemp(prefix="bench-device-"))
    runner = Runner(args.out, args.budget)
    runner.log.write_text(f"bench.device {' '.join(sys.argv[1:])}\n")
    results: dict = {
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("part", "limit")
        },
        "parts": runner.parts,
    }
    json_path = args.out / "device.json"
    save = lambda: write_results(json_path, "device", results)
    print(
        f"bench.device: {args.budget:.0f} s for the parts {', '.join(p for p in PARTS if p not in skip)}"
        f" ({'CPU dry run' if args.cpu else 'CUDA'}); log {runner.log}",
        flush=True,
    )
    me = [*python(), "-m", "bench.device", "--out", str(scratch), *(["--cpu"] if args.cpu else [])]

    if "gemm" not in skip:
        smi = shutil.which("nvidia-smi")
        if smi and not args.cpu:
            if ran := runner.run("nvidia-smi", [smi], 30):
                print(ran["text"], flush=True)
            query = [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
            try:
                results["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
            except (OSError, subprocess.SubprocessError) as error:
                results["nvidia_smi"] = f"failed: {error}"
        runner.run("gemm", [*me, "--part", "gemm"], CAP_GEMM)
        if (gemm := part_results(scratch / "gemm.json")) is not None:
            results["gemm"] = gemm
        save()

    if "sizes" not in skip:
        results["sizes"] = {}
        for n in map(int, args.sizes.split(",")):
            command = ensemble_command(n, args.size_steps, args.cpu, scratch / f"size_{n}", False, [])
            ran = runner.run(f"size_{n}", command, CAP_SIZE.get(n, CAP_SIZE_OTHER))
            if ran is None:
                results["sizes"][n] = {"status": "skipped"}
                continue
            results["sizes"][n] = {k: v for k, v in ran.items() if k not in ("text", "command")}
            results["sizes"][n] |= read_ensemble(ran["text"], n)
            shutil.rmtree(scratch / f"size_{n}", ignore_errors=True)
            save()

    if "overhead" not in skip:
        limit = runner.limit(CAP_OVERHEAD)
        command = [
            *me,
            "--part",
            "overhead",
            "--overhead-steps",
            str(args.overhead_steps),
            "--overhead-repeats",
            str(args.overhead_repeats),
            "--limit",
            str(limit or 0),
            *args.overrides,
        ]
        runner.run("overhead", command, CAP_OVERHEAD)
        if (scratch / "overhead.json").exists():
            results["overhead"] = json.loads((scratch / "overhead.json").read_text())
        save()

    if "tracked" not in skip:
        n = args.tracked
        command = ensemble_command(n, args.size_steps, args.cpu, scratch / "tracked", True, [])
        ran = runner.run("tracked", command, CAP_TRACKED)
        if ran is not None:
            results["tracked"] = {"n": n, **{k: v for k, v in ran.items() if k not in ("text", "command")}}
            results["tracked"] |= read_ensemble(ran["text"], n)
        shutil.rmtree(scratch / "tracked", ignore_errors=True)
        save()

    if "cuda" not in skip:
        cuda_json = args.out / "cuda.json"
        # a cuda.json here is a previous run's (foreign_output refused any other): gone, so that a cuda part
        # that fails or is never started leaves none to be read as this run's
        cuda_json.unlink(missing_ok=True)
        command = [
            *python(),
            "-m",
            "bench.cuda",
            "--steps",
            str(args.cuda_steps),
            "--repeats",
            str(args.cuda_repeats),
            "--out",
            str(cuda_json),
            *(["--dry-run"] if args.cpu else []),
        ]
        runner.run("cuda", command, CAP_CUDA)
        if (cuda := part_results(cuda_json)) is not None:
            results["cuda"] = cuda

    results["whole_s"] = time.monotonic() - started
    save()
    shutil.rmtree(scratch, ignore_errors=True)
    summary = table(results)
    with open(runner.log, "a") as log:
        log.write("\n" + summary + "\n")
    print(f"\nlog: {runner.log}; results: {json_path}\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
