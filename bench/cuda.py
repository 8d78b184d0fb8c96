"""The tracker on a CUDA GPU against the CPU: one snapshot of a trained model with every tracked
quantity on (every measure, the exact ablation and the attribution, every head behaviour, matching), on the GPU
in float32 and in float64, each against the CPU's float64 snapshot, beside the CPU's own float32
error as the yardstick; and what a snapshot takes on each, at the default shape and at paper scale.

    python -m bench.cuda [--steps 400] [--repeats 5] [--shapes default paper] [--out results.json]

Needs a CUDA device (exits 2 without one). Training here is a plain torch loop on the GPU (AdamW at
the default experiment's settings, repeated random tokens), so the snapshot reads a model with an
induction circuit.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time

import torch

from bench.axiom_table import SHAPE as DEFAULT
from bench.axiom_table import train_small_model
from bench.results_file import check_out, write_results
from data.probe import make_probe_batch
from metrics.composition.measures import WEIGHT_MEASURES
from metrics.snapshot import take_snapshot
from models.transformer import AttentionOnlyTransformer, TransformerShape

PAPER = TransformerShape(n_layers=2, n_heads=12, d_model=768, d_head=64, n_ctx=33, d_vocab=257)
SHAPES = {"default": DEFAULT, "paper": PAPER}


def results_of(snap) -> dict[str, torch.Tensor]:
    """Every tensor a snapshot holds, by name, on the CPU in float64."""
    out = {f"{m}/{k}": s for m, by_kind in snap["composition"].scores.items() for k, s in by_kind.items()}
    out |= {name: snap["behaviour"].score(name) for name in snap["behaviour"].behaviours}
    out |= {name: snap["writes"].score(name) for name in snap["writes"].names}
    out["matching"] = snap["matching"]
    out |= {f"ablation/{e}": v for e, v in snap["ablation"].effects.effects().items()}
    out["loss/repeated"] = torch.tensor(snap["loss_views"].repeated)
    return {name: value.detach().cpu().double() for name, value in out.items()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest ``|got - want|`` over ``max |want|`` (entries finite in both; NaN where neither is)."""
    finite = got.isfinite() & want.isfinite()
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().clamp_min(1e-30)
    return float(((got - want)[finite].abs().max() / scale).item())


def snapshot(model, probe, method: str, dtype=None):
    return take_snapshot(
        model,
        probe,
        composition={"measures": [*WEIGHT_MEASURES, "share"], "baseline_samples": 200},
        ablation={"method": method},
        writes=True,
        matching=True,
        dtype=dtype,
    )


def seconds(model, probe, method: str, repeats: int, device: str) -> float:
    """Median wall seconds of one snapshot (synchronised), after one warm-up."""
    model = model.to(device)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        snapshot(model, probe, method)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps before the snapshot")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES), help="the shapes timed (default: both)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="the CPU in the GPU's place (checks the script, not a GPU)"
    )
    args = parser.parse_args(argv)
    check_out(args.out)  # before any work: never over a file no benchmark wrote
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    report = {"device": name, "torch": torch.__version__, "steps": args.steps}
    model = train_small_model(args.steps, device=device).cpu()
    probe = make_probe_batch(0, 16, 16, DEFAULT.d_vocab - 1)
    errors = {}
    copy_of = lambda: copy.deepcopy(model)
    for method in ("exact", "attribution"):
        reference = results_of(snapshot(copy_of().double(), probe, method))
        runs = {
            "cpu float32": results_of(snapshot(copy_of(), probe, method)),
            "cuda float32": results_of(snapshot(copy_of().to(device), probe, method)),
            "cuda float64": results_of(snapshot(copy_of().to(device), probe, method, torch.float64)),
        }
        for run, got in runs.items():
            for name, want in reference.items():
                if name.startswith("ablation/"):
                    errors.setdefault(f"{name} ({method})", {})[run] = relative_error(got[name], want)
                elif method == "exact":
                    errors.setdefault(name, {})[run] = relative_error(got[name], want)
    report["relative_error_against_cpu_float64"] = errors
    timing = {}
    for label in dict.fromkeys(args.shapes):  # each once, in the order given
        shape = SHAPES[label]
        where = dict.fromkeys(("cpu", device) if shape is DEFAULT else (device,))  # the CPU once in a dry run
        torch.manual_seed(0)
        timed = AttentionOnlyTransformer(shape)
        timed_probe = make_probe_batch(0, 16 if shape is DEFAULT else 32, 16, shape.d_vocab - 1)
        for method in ("exact", "attribution"):
            for on in where:
                timing[f"{label} {method} {on}"] = seconds(copy.deepcopy(timed), timed_probe, method, args.repeats, on)
    report["snapshot_seconds"] = timing
    print(f"{report['device']}, torch {report['torch']}; a snapshot of every quantity after {args.steps} steps")
    print("relative error against the CPU's float64 snapshot (largest |diff| / largest |value|):")
    columns = sorted({c for row in errors.values() for c in row})
    width = max(map(len, errors)) + 2
    print("  " + "quantity".ljust(width) + "".join(c.rjust(14) for c in columns))
    for name, row in errors.items():
        cells = "".join((f"{row[c]:.1e}" if c in row and math.isfinite(row[c]) else "-").rjust(14) for c in columns)
        print("  " + name.ljust(width) + cells)
    print("seconds per snapshot (median):")
    for key, value in timing.items():
        print(f"  {key:<28}{value:>10.4f}")
    if args.out:
        write_results(args.out, "cuda", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
