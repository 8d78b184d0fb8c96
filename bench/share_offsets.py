"""Does the share's centring over the sequences take out the induction match itself? The circuit
pair's K share on a probe whose second copy starts at the same position in every sequence, against
the same sequences with that start varying.

    python -m bench.share_offsets RUN_DIR                        # one run
    python -m bench.share_offsets multirun/DATE/TIME             # every job of a sweep
    python -m bench.share_offsets RUN_DIR --steps 0,300,400,1500 --shift 8 --batch 64

The tracker's probe (``[BOS], t_1 .. t_n, t_1 .. t_n``) puts an induction head's match (query ``i``
of the second copy, key ``i − n + 1``) at the same ``(i, j)`` in every sequence. The default share
(docs/measures.md, measure 8) centres the scores over the sequences at each ``(i, j)`` to take out
what every sequence gets alike, so on that probe it takes out the match's mean score too, and what
it shares out is how the scores vary with the tokens. Whether that reads the writer differently
from a probe where the match moves is measured here, on a run's saved weights (``trajectory/``):
``[BOS], filler × r_b, t_1 .. t_n, t_1 .. t_n, filler × (shift − r_b)`` with the same tokens in
both probes, ``r_b = 0`` in every sequence (**fixed**) or drawn from ``0 .. shift`` (**moving**),
``n = (n_ctx − 1 − shift) // 2``; the rows of each sequence's second copy weigh. Its null: a
second fixed probe with other tokens (**fixed′**), what a fresh draw of the probe moves the share
by. Both centrings (over the ``sequences``, the default, and ``none``: the rows only) on the three;
the circuit pair is the run's (``reports.rise``: the pair whose ablation moves the loss most at the
last ablation step).

Prints, per run, the pair's K share at each step; then, per centring over every run and step, the
median and largest ``|fixed − moving|`` beside ``|fixed − fixed′|``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from metrics.composition.data_shares import CENTRES, data_shares
from records.layout import SUMMARY_NAME, TENSORS_DIR, job_dirs, run_label
from records.tensor_store import read_tensor_store
from records.trajectory import Trajectory
from reports.rise import causal_pair

DEFAULT_STEPS = (0, 200, 250, 300, 340, 380, 420, 470, 600, 1000, 1500)
"""Through the default run's phase change (onset ~300-360, end ~430-460); each read at the nearest saved step."""


def offset_probes(
    batch: int, n: int, shift: int, n_random: int, seed: int = 0
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``((tokens, weights), (tokens, weights))``, the fixed probe then the moving one, each
    ``[batch, 2 n + 1 + shift]``; the weights are 1 on each sequence's second copy. The same
    blocks and filler in both; BOS is ``n_random`` (:mod:`data.repeated`)."""
    rng = np.random.default_rng(seed)
    length = 2 * n + 1 + shift
    blocks = torch.from_numpy(rng.integers(0, n_random, (batch, n)))
    filler = torch.from_numpy(rng.integers(0, n_random, (batch, shift)))
    starts = (np.zeros(batch, dtype=int), rng.integers(0, shift + 1, batch))
    probes = []
    for start in starts:
        tokens = torch.full((batch, length), n_random, dtype=torch.long)
        weights = torch.zeros(batch, length, dtype=torch.float64)
        for b, r in enumerate(start.tolist()):
            tokens[b, 1 : 1 + r] = filler[b, :r]
            tokens[b, 1 + r : 1 + r + n] = blocks[b]
            tokens[b, 1 + r + n : 1 + r + 2 * n] = blocks[b]
            tokens[b, 1 + r + 2 * n :] = filler[b, r:]
            weights[b, 1 + r + n : 1 + r + 2 * n] = 1.0
        probes.append((tokens, weights))
    return probes[0], probes[1]


@torch.no_grad()
def k_share(model, tokens: Tensor, weights: Tensor, pair: tuple[int, int, int, int], centre: str) -> float:
    """The writer's K share in the reader (``pair = (l1, h1, l2, h2)``) on ``tokens``, in float64."""
    model = model.double()
    _, cache = model.run_with_cache(tokens)
    return float(data_shares(model, tokens, cache, weights, centre).heads["K"][pair])


def nearest(saved: list[int], wanted: tuple[int, ...]) -> list[int]:
    """The saved steps nearest each wanted one, each once, in order."""
    return sorted({min(saved, key=lambda s: abs(s - w)) for w in wanted})


def run_rows(run: Path, wanted: tuple[int, ...], shift: int, batch: int) -> tuple[str, list[tuple]]:
    """``(header, rows)`` of one run: rows ``(step, {centre: (fixed, moving, fixed′)})``."""
    trajectory = Trajectory(run)
    shape = trajectory.model(trajectory.steps[0]).shape
    n = (shape.n_ctx - 1 - shift) // 2
    if n < 2:
        raise ValueError(f"n_ctx={shape.n_ctx} leaves no room for two copies with --shift {shift}")
    store = read_tensor_store(run / TENSORS_DIR)
    if "ablation/loss_change" not in store:
        raise ValueError(f"{run / TENSORS_DIR} has no ablation/loss_change: no causal pair to read")
    pair = causal_pair(store["ablation/loss_change"][1][-1])
    fixed, moving = offset_probes(batch, n, shift, shape.d_vocab - 1)
    probes = (fixed, moving, offset_probes(batch, n, shift, shape.d_vocab - 1, seed=1)[0])
    rows = []
    for step in nearest(trajectory.steps, wanted):
        model = trajectory.model(step).eval()
        rows.append((step, {c: [k_share(model, *probe, pair, c) for probe in probes] for c in CENTRES}))
    summary = json.loads((run / SUMMARY_NAME).read_text())
    when = ", ".join(f"{k} {summary.get(f'phase_change/loss_{k}_step', float('nan')):.0f}" for k in ("onset", "end"))
    header = f"{run_label(run)}: L{pair[0]}H{pair[1]}->L{pair[2]}H{pair[3]} ({when}); n {n}, start 0 or 0-{shift}"
    return header, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="+", help="run directories or sweep directories")
    parser.add_argument("--steps", default=",".join(map(str, DEFAULT_STEPS)), help="steps (nearest saved)")
    parser.add_argument("--shift", type=int, default=8, help="the moving probe's starts: 0 .. SHIFT")
    parser.add_argument("--batch", type=int, default=64, help="sequences in each probe")
    args = parser.parse_args(argv)
    try:
        wanted = tuple(int(s) for s in args.steps.split(","))
    except ValueError:
        print(f"error: --steps {args.steps!r}: a comma-separated list of steps", file=sys.stderr)
        return 1
    if args.shift < 1 or args.batch < 2:
        print("error: --shift must be >= 1 and --batch >= 2", file=sys.stderr)
        return 1
    runs = job_dirs(args.paths)
    if not runs:
        print(f"error: no run directory in {', '.join(map(str, args.paths))}", file=sys.stderr)
        return 1
    missing = [str(r) for r in runs if not (r / "trajectory").is_dir() or not (r / TENSORS_DIR).is_dir()]
    if missing:
        print(f"error: no trajectory/ and {TENSORS_DIR}/ in {', '.join(missing)}", file=sys.stderr)
        return 1
    moved, redrawn = ({c: [] for c in CENTRES} for _ in range(2))
    for run in runs:
        try:
            header, rows = run_rows(run, wanted, args.shift, args.batch)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(header)
        print(("         " + "".join(f"centred over {c}".ljust(30) for c in CENTRES)).rstrip())
        print(("   step  " + "fixed   moving  fixed'        " * len(CENTRES)).rstrip())
        for step, shares in rows:
            cells = ("".join(f"{v:<8.3f}" for v in shares[c]).ljust(30) for c in CENTRES)
            print((f"  {step:5d}  " + "".join(cells)).rstrip())
            for c in CENTRES:
                moved[c].append(abs(shares[c][0] - shares[c][1]))
                redrawn[c].append(abs(shares[c][0] - shares[c][2]))
    for c in CENTRES:
        m, r = np.array(moved[c]), np.array(redrawn[c])
        print(
            f"centred over {c}: |fixed - moving| median {np.median(m):.3f}, largest {m.max():.3f}; "
            f"|fixed - fixed'| median {np.median(r):.3f}, largest {r.max():.3f} ({len(m)} steps)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
