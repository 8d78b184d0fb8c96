"""A sweep over training-time interventions, read as one result: each group's curves (repeated-token
loss, the circuit pair's K-composition) and the training-time validity table.

The table asks of each composition measure: does it read "circuit" in the runs whose circuit
formed, and "no circuit" in those where an intervention prevented it? At a job's last snapshot:

- **the truth**: the circuit pair's K-only path ablation (``circuit/ablation/pattern_change``, the
  tracker's ground truth: on the model as it trains when the interventions are all in layer 0,
  else on its weights without them): the circuit is there when replacing the writer in the
  reader's keys moves at least :data:`CIRCUIT_PATTERN` of the reader's attention (total variation);
- **a measure reads "circuit"** when the pair's score is above its null: its random baseline
  (``circuit/K/{measure}_minus_baseline > 0``) for the seven weight measures; for the data-aware
  ``share``, which has no random-matrix baseline, the pair's own share at step 0 (the randomly
  initialised model).

Whether the loss fell (a phase change detected) is a column of its own: a clamp can make the loss
fall with no K-composition at all.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from metrics.composition.data_shares import SHARE

CIRCUIT_PATTERN = 0.1
"""The share of the reader's attention (total variation, in [0, 1]) that the circuit pair's K-only
ablation must move for "circuit". The default run's seeds 0-3 move 0.24-0.44 at their last step and
every layer-0 head ablated from step 0 leaves 0.02 (docs/results.md, "Interventions during training";
chosen after seeing those, and the table prints each group's values beside it). The loss effect is
not used: a circuit with two writers (seed 3) loses only 0.14 nats to either one's ablation."""
CURVES = {
    "loss/repeated": "loss on repeated tokens",
    "circuit/K/frobenius_minus_baseline": "circuit pair K-comp,\nFrobenius minus baseline",
    "circuit/K/share": "circuit pair K share\n(data-aware)",
}
"""The series drawn per group, and their axis labels."""


def circuit_values(series: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """A job's last-snapshot numbers the table reads: ``truth_pattern_change``, and per measure
    ``reads_{measure}`` (1 circuit, 0 none) from its score minus its null."""
    values: dict[str, float] = {}
    if "circuit/ablation/pattern_change" in series:
        values["truth_pattern_change"] = float(series["circuit/ablation/pattern_change"][1][-1])
    for key, (_, points) in series.items():
        if key.startswith("circuit/K/") and key.endswith("_minus_baseline"):
            values[f"reads_{key.removeprefix('circuit/K/').removesuffix('_minus_baseline')}"] = float(points[-1] > 0)
    if f"circuit/K/{SHARE}" in series:
        points = series[f"circuit/K/{SHARE}"][1]
        values[f"reads_{SHARE}"] = float(points[-1] > points[0])
    return values


def validity_rows(jobs, settings: list[str]) -> list[dict]:
    """Per group of jobs (the same non-seed settings): how many formed the circuit (the truth), how
    many had a loss cliff, and per measure how many read "circuit"; a last row per measure, over all
    jobs: the share of jobs whose reading matches the truth."""
    groups: dict[tuple, list] = {}
    for job in jobs:
        if "truth_pattern_change" in job.values:
            groups.setdefault(tuple(job.overrides.get(k, "") for k in settings), []).append(job)
    measures = sorted({k.removeprefix("reads_") for job in jobs for k in job.values if k.startswith("reads_")})
    rows = []
    for key, members in groups.items():
        n = len(members)
        truths = [job.values["truth_pattern_change"] for job in members]
        cliffs = sum(math.isfinite(_number(job.values.get("phase_change_midpoint"))) for job in members)
        row = {
            "group": " ".join(v for v in key if v) or "all",
            "jobs": n,
            "cliff": f"{cliffs}/{n}",
            "ablation moves": f"{min(truths):.2f}-{max(truths):.2f}",
            "circuit": f"{sum(t >= CIRCUIT_PATTERN for t in truths)}/{n}",
        }
        for measure in measures:
            reads = [job.values.get(f"reads_{measure}") for job in members]
            row[measure] = f"{sum(r == 1 for r in reads)}/{sum(r is not None for r in reads)}"
        rows.append(row)
    if rows:
        judged = [job for members in groups.values() for job in members]
        agreement = {
            "group": "agrees with the truth",
            "jobs": len(judged),
            "cliff": "",
            "ablation moves": "",
            "circuit": "",
        }
        for measure in measures:
            pairs = [
                (job.values[f"reads_{measure}"] == 1, job.values["truth_pattern_change"] >= CIRCUIT_PATTERN)
                for job in judged
                if f"reads_{measure}" in job.values
            ]
            agreement[measure] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        rows.append(agreement)
    return rows


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def draw_groups(jobs, settings: list[str], path: Path) -> None:
    """Each group's mean curve over its seeds (the band: min to max) of :data:`CURVES`, one panel each."""
    from reports.plots import plt  # here: reading the groups loads no plotting library

    groups: dict[str, list] = {}
    for job in jobs:
        label = " ".join(job.overrides.get(k, "") for k in settings if job.overrides.get(k, "")) or "all"
        groups.setdefault(label, []).append(job)
    fig, axes = plt.subplots(len(CURVES), 1, figsize=(9, 2.8 * len(CURVES)), sharex=True)
    colours = plt.get_cmap("tab10")(np.arange(len(groups)) % 10)
    for colour, (label, members) in zip(colours, groups.items()):
        for ax, key in zip(axes, CURVES):
            curves = [job.curves[key] for job in members if key in job.curves]
            if not curves:
                continue
            steps = curves[0][0]
            same = [values for s, values in curves if len(s) == len(steps) and np.array_equal(s, steps)]
            stacked = np.vstack(same)
            ax.plot(steps, stacked.mean(0), color=colour, lw=1.4, label=f"{label} (n={len(same)})")
            ax.fill_between(steps, stacked.min(0), stacked.max(0), color=colour, alpha=0.15, lw=0)
    for ax, ylabel in zip(axes, CURVES.values()):
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    axes[1].axhline(0, color="k", lw=0.6, ls=":")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("training step")
    fig.suptitle("interventions: mean over seeds per group (band: min to max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
