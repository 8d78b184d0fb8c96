"""How many keys a snapshot logs, by W&B section, for a model shape: counted from the tracked
quantities themselves (one real snapshot of a random model with every quantity on, flattened as a
run of that shape flattens it), so the count follows any quantity or measure added.

    python -m reports.tracker_keys                          # the default model, 2 x 2 x 64 x 16
    python -m reports.tracker_keys --shape 12 12 768 64     # paper scale
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch

from data.probe import make_probe_batch
from data.task import tasks
from metrics.snapshot import measure
from metrics.tracked.base import tracked_quantities
from metrics.tracked.options import TrackerOptions
from models.transformer import AttentionOnlyTransformer, TransformerShape
from records.keys import pair_key_count, snapshot_metrics
from records.wandb_sections import section_of

DEFAULT_SHAPE = (2, 2, 64, 16)


def key_counts(shape: TransformerShape, options: TrackerOptions | None = None) -> tuple[Counter, bool]:
    """``({section: keys}, per_pair)``: every tracked quantity with its default options, all due, at
    init, on the default task (repeated tokens: its three strategies); ``per_pair`` whether the shape
    logs a key per pair (:mod:`records.keys`)."""
    options = options or TrackerOptions()
    torch.manual_seed(0)
    model = AttentionOnlyTransformer(shape)
    task = tasks()["repeated"](seq_len=shape.n_ctx)
    quantities = [cls().for_task(task, shape.d_vocab - 1) for cls in tracked_quantities().values()]
    probe = make_probe_batch(0, options.probe_batch_size, options.probe_n or task.probe_block(), shape.d_vocab - 1)
    snap = measure(model, probe, quantities)
    keys_per_pair = sum(q.pair_keys for q in quantities if q.applies(model))
    per_pair = pair_key_count(shape.n_layers, shape.n_heads, keys_per_pair) <= options.max_pair_keys
    keys = snapshot_metrics(snap.outputs, snap.circuit, per_pair, options.top_pairs, options.max_head_keys)
    return Counter(section_of(key) or "(no section)" for key in keys), per_pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", type=int, nargs=4, default=DEFAULT_SHAPE, metavar=("LAYERS", "HEADS", "D_MODEL", "D_HEAD")
    )
    args = parser.parse_args(argv)
    n_layers, n_heads, d_model, d_head = args.shape
    shape = TransformerShape(n_layers, n_heads, d_model, d_head, n_ctx=33, d_vocab=257)
    counts, per_pair = key_counts(shape)
    mode = "a key per pair" if per_pair else "summaries of the pairs (beyond tracker.max_pair_keys)"
    print(f"{n_layers} x {n_heads} x {d_model} x {d_head}, the default tracked quantities: {mode}")
    for section in sorted(counts):
        print(f"  {section:<16}{counts[section]:>6}")
    print(f"  {'all':<16}{sum(counts.values()):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
