"""The second null of the head types read from the refined LLC alone (docs/results.md, "Every head's
development"): the rLLC curves of a run whose types were prevented (its induction heads ablated from
step 0), clustered and compared, by ARI, with the behaviour types the same heads take in the intact
run of the same seed. Where the heads' *positions* (their layer) decide the clusters rather than what
they become, this null reaches the intact run's ARI; where the types do, it falls toward 0.

    python -m bench.head_type_null ABLATED_RUN INTACT_RUN [--name stages] [--layer L]

``--layer L``: that layer's heads only, the types within one layer (where the layer cannot decide).
The same run twice (``RUN RUN``) gives the run's own agreement.

Both runs need ``python -m analysis.stages RUN --every 8`` (every head's λ̂ in ``analysis/NAME/llc.csv``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

from metrics.dynamics.head_clusters import cluster_agreement
from records.layout import ANALYSIS_DIR, ANALYSIS_RECORD, LLC_TABLE


def head_curves(run_dir: Path, name: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(steps, {LxHy: λ̂ over the steps})`` of every head from the run's stage analysis ``name``."""
    with open(run_dir / ANALYSIS_DIR / name / LLC_TABLE, newline="") as handle:
        rows = list(csv.DictReader(handle))
    heads = [key[4:] for key in rows[0] if key.startswith("llc_L") and "H" in key and key[4:].count("_") == 0]
    steps = np.array([float(row["step"]) for row in rows])
    return steps, {head: np.array([float(row[f"llc_{head}"]) for row in rows]) for head in heads}


def final_types(run_dir: Path, name: str) -> dict[str, str]:
    """Each head's behaviour type at the run's last snapshot, as its stage analysis recorded it."""
    record = json.loads((run_dir / ANALYSIS_DIR / name / ANALYSIS_RECORD).read_text())
    return record["result"]["head_types"]["types"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ablated", type=Path)
    parser.add_argument("intact", type=Path)
    parser.add_argument("--name", default="stages", help="the stage analysis's name in both runs")
    parser.add_argument("--layer", type=int, default=None, help="one layer's heads only: types within a layer")
    args = parser.parse_args(argv)
    steps, curves = head_curves(args.ablated, args.name)
    intact_types, own_types = final_types(args.intact, args.name), final_types(args.ablated, args.name)
    heads = sorted(h for h in curves if args.layer is None or h.startswith(f"L{args.layer}H"))
    values = np.stack([curves[h] for h in heads])
    finite = np.isfinite(values).all(axis=0)
    for label, types in (("the intact run's types", intact_types), ("its own types", own_types)):
        labels = np.array([types[h] for h in heads])
        if len(np.unique(labels)) < 2:
            print(f"{args.ablated} against {label}: one type only ({labels[0]}), no ARI")
            continue
        found = cluster_agreement(steps[finite], values[:, finite], labels)
        clusters = dict(zip(heads, found.labels.tolist(), strict=True))
        print(
            f"{args.ablated} against {label}: ARI {found.ari:.2f} (null mean {found.null_mean:.2f}, 95 % "
            f"{found.null_95:.2f}, p {found.p:.3f}); clusters {clusters}; types {dict(zip(heads, labels.tolist(), strict=True))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
