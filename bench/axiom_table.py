"""Print the table of composition measures × docs/measures.md axioms, one command:

    python -m bench.axiom_table              # trains the default-shaped model briefly, then checks
    python -m bench.axiom_table --steps 0    # axiom 4 on the untrained model instead

Axioms 1-3 run on constructed matrices; axiom 4 on a trained 2-layer attention-only model (no
normalization, so every residual GL transform is a symmetry), after checking that each
reparametrisation leaves the logits unchanged. Exits 1 if one does not.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch

from bench.axioms import (  # noqa: E402
    INVARIANCE_TOLERANCE,
    LOGIT_TOLERANCE,
    AxiomTable,
    ConstructedScores,
    axiom_table,
)
from data.probe import make_probe_batch  # noqa: E402
from data.tasks.repeated import Repeated  # noqa: E402
from metrics.composition.data_shares import SHARE  # noqa: E402
from metrics.dynamics.loss_views import repeated_loss, token_losses  # noqa: E402
from models.lit_module import next_token_loss  # noqa: E402
from models.transformer import AttentionOnlyTransformer, TransformerShape  # noqa: E402

SHAPE = TransformerShape(n_layers=2, n_heads=2, d_model=64, d_head=16, n_ctx=33, d_vocab=257)


def train_small_model(steps: int, seed: int = 0, batch_size: int = 32, device: str = "cpu") -> AttentionOnlyTransformer:
    """The default experiment's model and data (AdamW 3e-3, 100 warmup steps, clip 1), plain torch,
    trained on ``device`` (initialized on the CPU, so the same model wherever it trains)."""
    torch.manual_seed(seed)
    model = AttentionOnlyTransformer(SHAPE).to(device)
    sample = Repeated(seed=seed, seq_len=SHAPE.n_ctx).sampler(SHAPE.d_vocab - 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    for step in range(steps):
        tokens = sample(np.arange(step * batch_size, (step + 1) * batch_size)).to(device)
        loss = next_token_loss(model(tokens), tokens)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
    return model


def constructed_cells(c: ConstructedScores) -> list[str]:
    value = lambda v: "undefined" if math.isnan(v) else f"{v:.3f}"
    path = c.rotation_path
    shape = f"{'monotone' if c.monotone else 'NOT monotone'}, {'smooth' if c.smooth else 'NOT smooth'}"
    return [
        value(c.aligned_rank_one),
        value(c.aligned),
        value(c.orthogonal),
        f"{shape} ({value(path[0])} → {value(path[-1])})",
    ]


def markdown_table(table: AxiomTable) -> str:
    transforms = list(table.invariance)
    headers = [
        "measure",
        "1: aligned, rank 1",
        "1: aligned, rank 3",
        "2: orthogonal",
        "3: write subspace rotates away",
        *(f"4: {name}" for name in transforms),
    ]
    rows = []
    for measure in next(iter(table.invariance.values())).score_change:
        constructed = table.constructed.get(measure)
        what = "n/a (reads the probe pass)" if measure == SHARE else "n/a (token-space score)"
        cells = constructed_cells(constructed) if constructed else [what] + ["n/a"] * 3
        for name in transforms:
            inv = table.invariance[name]
            change = inv.score_change[measure]
            cells.append("invariant" if inv.invariant(measure) else f"**changes** (up to {change:.2g})")
        rows.append([measure, *cells])
    line = lambda items: "| " + " | ".join(items) + " |"
    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(r) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Check every composition measure against docs/measures.md's axioms 1-4."
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=600,
        help="training steps for the axiom-4 model (default 600: past the induction cliff)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the training run and of the random reparametrisations"
    )
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error(f"--steps={args.steps} must be >= 0")
    start = time.perf_counter()
    model = train_small_model(args.steps, args.seed)
    probe = make_probe_batch(args.seed, 32, 16, SHAPE.d_vocab - 1)
    with torch.no_grad():
        loss = repeated_loss(token_losses(model(probe.tokens), probe.tokens), probe).item()
    table = axiom_table(model, probe.tokens, seed=args.seed)
    print(
        "Axioms 1-3: constructed matrices (d_model 12, rank 3; the whitened and token-space ratios there are Frobenius with Σ = I)."
    )
    print(
        f"Axiom 4: {SHAPE.n_layers}-layer, {SHAPE.n_heads}-head attention-only model trained {args.steps} steps"
        f" (repeated-token loss {loss:.3f} nats on the probe), scores in float64; invariant = no pair's score"
        f" moves by more than {INVARIANCE_TOLERANCE:g}."
    )
    broken = []
    for name, inv in table.invariance.items():
        print(f"  {name:18s} logits move by at most {inv.logit_change:.1e} (must be <= {LOGIT_TOLERANCE:g})")
        if not inv.function_preserved:
            broken.append(name)
    print()
    print(markdown_table(table))
    print(f"\n({time.perf_counter() - start:.1f} s)")
    if broken:
        print(f"error: {', '.join(broken)} changed the logits: not a symmetry of this model", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
