"""What the data-aware share costs in a snapshot, against the Frobenius measure, at one shape.

    python -m bench.share                                     # 12 x 12 x 768 x 64, the papers' size
    python -m bench.share --shape 2 2 64 16 --repeats 50      # the default experiment's

Both are timed inside ``take_snapshot`` as the tracker runs them (its own timer: the ``composition``
part, float32, the tracker's probe batch of 16 sequences of 33 tokens), on one random model, the
two interleaved (Frobenius, share, Frobenius, share, ...) after one untimed round of each, on the
threads torch has (``--threads`` to set them). The probe pass is the same for both (the share forms
the heads' writes itself, a few positions at a time) and is reported beside them. Prints the
medians and the ratio; exits 1 when the share costs more than Frobenius.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from data.probe import make_probe_batch
from metrics.snapshot import take_snapshot
from models.transformer import AttentionOnlyTransformer, TransformerShape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[12, 12, 768, 64], metavar=("L", "H", "D", "E"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n_layers, n_heads, d_model, d_head = args.shape
    torch.manual_seed(0)
    model = AttentionOnlyTransformer(TransformerShape(n_layers, n_heads, d_model, d_head, 33, 257)).eval()
    probe = make_probe_batch(0, 16, 16, 256, True)
    measured = {"frobenius": [], "share": []}
    probes = {"frobenius": [], "share": []}
    for repeat in range(args.repeats + 1):
        for measure in measured:
            snap = take_snapshot(model, probe, composition={"measures": [measure]})
            if repeat:  # the first round pays one-time costs (the cached random baseline, allocations)
                measured[measure].append(snap.seconds["composition"])
                probes[measure].append(snap.seconds["probe"])
    median = {m: statistics.median(v) for m, v in measured.items()}
    print(
        f"shape {n_layers} x {n_heads} x {d_model} x {d_head}, probe 16 x 33, {torch.get_num_threads()} threads,"
        f" {args.repeats} repeats interleaved"
    )
    for measure, seconds in measured.items():
        print(
            f"  {measure:<10} composition {1000 * median[measure]:9.1f} ms (runs {', '.join(f'{1000 * s:.1f}' for s in seconds)});"
            f" probe pass {1000 * statistics.median(probes[measure]):.1f} ms"
        )
    ratio = median["share"] / median["frobenius"]
    print(f"share / Frobenius: {ratio:.2f} (target <= 1: {'met' if ratio <= 1 else 'NOT met'})")
    return 0 if ratio <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
