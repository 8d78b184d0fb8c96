"""What every head of a run became and when, from its tensor store: each head's behaviour type at
every snapshot (:mod:`metrics.heads.behaviour`), the steps where it changes (with bootstrap
intervals over the probe's sequences), the summary keys, and the figure ``heads.png`` (the heads ×
steps type map; each head's score at its final type's behaviour over training, coloured by its type
at each step)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from metrics.heads.behaviour import (
    BUILT_IN_BEHAVIOURS,
    PREFIX_MATCHING,
    Null,
    behaviour_colour,
    head_types,
    type_names_of,
    type_switches,
)
from metrics.tracked.head_behaviour import NULL_MEAN, NULL_STD, PER_SEQUENCE
from records.tensor_store import read_tensor_store, tensor_labels

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SUMMARY_PREFIX = "heads/"
"""The summary's keys of every head: ``heads/type/LxHy``, ``heads/switch/LxHy/i``, ``heads/types``."""
SUMMARY_KEYS = tuple(f"{SUMMARY_PREFIX}{part}" for part in ("type/", "switch/", "types"))


@dataclass(frozen=True)
class HeadHistory:
    """``steps [n]``; ``scores [n, L, H, behaviours]`` (mean over the probe's sequences; ``names`` its last
    axis); ``types [n, L, H]`` (codes into :attr:`type_names`); ``behaviours`` read; ``switches[l][h]``:
    that head's type switches."""

    steps: np.ndarray
    scores: np.ndarray
    types: np.ndarray
    behaviours: tuple[str, ...]
    switches: list[list[list]]
    names: tuple[str, ...] = BUILT_IN_BEHAVIOURS

    @property
    def shape(self) -> tuple[int, int]:
        return self.types.shape[1], self.types.shape[2]

    @property
    def type_names(self) -> tuple[str, ...]:
        """A type code's name: 0 unspecialised, ``i + 1`` the ``i``-th of :attr:`names`."""
        return type_names_of(self.names)

    def final_type(self, layer: int, head: int) -> str:
        return self.type_names[int(self.types[-1, layer, head])]


def head_label(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def head_of(label: str) -> tuple[int, int]:
    """``"L1H3"`` -> ``(1, 3)``."""
    layer, head = label[1:].split("H")
    return int(layer), int(head)


def reader_behaviour(task_name: str | None) -> str:
    """The prefix-matching behaviour the run's task reads (``Task.reader_behaviour``; ``induction`` for
    a task not installed here)."""
    from data.task import tasks

    task = tasks().get(task_name or "")
    return task.reader_behaviour if task is not None else "induction"


def read_head_history(store_dir: Path, prefix_matching: str = "induction") -> HeadHistory | None:
    """Every head's history from the tensor store (None: the run tracked no behaviours), typed by the
    behaviours with a score anywhere in the run, prefix matching under the run's task's name for it
    (``prefix_matching``: its ``Task.reader_behaviour``)."""
    if not store_dir.is_dir():
        return None
    stored = read_tensor_store(store_dir, [PER_SEQUENCE, NULL_MEAN, NULL_STD])
    if len(stored) < 3:
        return None
    steps, per_sequence = stored[PER_SEQUENCE]  # (n, L, b, H, behaviours)
    names = tuple(tensor_labels(store_dir).get(PER_SEQUENCE, BUILT_IN_BEHAVIOURS))  # unlabelled: the built-in axis
    per_sequence = torch.from_numpy(np.asarray(per_sequence, dtype=np.float64))
    null = Null(torch.from_numpy(stored[NULL_MEAN][1][-1]).double(), torch.from_numpy(stored[NULL_STD][1][-1]).double())
    scores = per_sequence.nanmean(dim=2)  # (n, L, H, behaviours)
    read = ~scores.isnan().all(dim=(0, 1, 2))
    behaviours = tuple(
        name
        for i, name in enumerate(names)
        if bool(read[i]) and (name not in PREFIX_MATCHING or name == prefix_matching)  # one mask, two names
    )
    types = head_types(scores, null, behaviours, names=names).numpy()
    n, L, b, H, B = per_sequence.shape
    by_head = per_sequence.permute(0, 2, 1, 3, 4).reshape(n, b, L * H, B)  # (n, b, heads, behaviours)
    found = type_switches(steps, by_head, null, behaviours, names=names)
    switches = [[found[layer * H + head] for head in range(H)] for layer in range(L)]
    return HeadHistory(steps, scores.numpy(), types, behaviours, switches, names)


def head_summary(history: HeadHistory) -> dict[str, object]:
    """``heads/type/LxHy`` (each head's type at the last snapshot), ``heads/switch/LxHy/{i}``
    (``"unspecialised → previous_token"``) with its ``/step``, ``/low``, ``/high`` and ``/found``, and
    ``heads/types`` (the types the heads end with, unspecialised left out, comma-separated)."""
    summary: dict[str, object] = {}
    L, H = history.shape
    final = set()
    for layer in range(L):
        for head in range(H):
            label = head_label(layer, head)
            kind = history.final_type(layer, head)
            summary[f"{SUMMARY_PREFIX}type/{label}"] = kind
            if kind != history.type_names[0]:
                final.add(kind)
            for i, switch in enumerate(history.switches[layer][head], start=1):
                key = f"{SUMMARY_PREFIX}switch/{label}/{i}"
                summary[key] = switch.label
                summary[f"{key}/step"] = float(switch.step)
                summary.update({f"{key}/low": switch.low, f"{key}/high": switch.high, f"{key}/found": switch.found})
    summary[f"{SUMMARY_PREFIX}types"] = ", ".join(sorted(final))
    return summary


def head_lines(summary: dict[str, object]) -> list[str]:
    """One line a head from :func:`head_summary`'s keys: its final type and each switch with its interval."""
    lines = []
    for key, kind in summary.items():
        if not key.startswith(f"{SUMMARY_PREFIX}type/"):
            continue
        label = key.rsplit("/", 1)[1]
        switches, i = [], 1
        while (switch := summary.get(f"{SUMMARY_PREFIX}switch/{label}/{i}")) is not None:
            at = f"{SUMMARY_PREFIX}switch/{label}/{i}"
            switches.append(
                f"{switch} at {summary[at + '/step']:.0f} [{summary[at + '/low']:.0f}, {summary[at + '/high']:.0f}]"
            )
            i += 1
        lines.append(f"{label}: {kind}" + (f" ({'; '.join(switches)})" if switches else ""))
    return lines


def heads_figure(
    history: HeadHistory,
    title: str,
    llc: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    clusters: dict[str, int] | None = None,
    caption: str = "",
) -> Figure:
    """Left: the heads × steps type map. Middle: each head's curve over training, coloured by its type
    at each step — its weight-refined LLC where ``llc`` (``{LxHy: (steps, values)}``) has it, else its
    score at its final type's behaviour (at its largest behaviour for an unspecialised head). With
    ``clusters`` (``{LxHy: cluster}``, :mod:`metrics.dynamics.head_clusters`), right: the table of
    clusters against final types, ``caption`` beneath it (the ARI and its null)."""
    from matplotlib.colors import ListedColormap  # here: reading a history (the explorer) loads no plotting library

    from reports.plots import plt

    L, H = history.shape
    labels = [head_label(layer, head) for layer in range(L) for head in range(H)]
    codes = history.types.reshape(len(history.steps), L * H).T  # (heads, n)
    type_names = history.type_names
    colours = ListedColormap([behaviour_colour(name) for name in type_names])
    panels = 3 if clusters else 2
    fig, axes = plt.subplots(
        1, panels, figsize=(6.5 * panels, max(3.5, 0.35 * len(labels) + 1.5)), width_ratios=[1, 1, 0.8][:panels]
    )
    left, right = axes[0], axes[1]
    x = history.steps
    edges = (
        np.concatenate([[x[0]], (x[1:] + x[:-1]) / 2, [x[-1]]]) if len(x) > 1 else np.array([x[0] - 0.5, x[0] + 0.5])
    )
    left.pcolormesh(edges, np.arange(len(labels) + 1), codes, cmap=colours, vmin=-0.5, vmax=len(type_names) - 0.5)
    left.set_yticks(np.arange(len(labels)) + 0.5, labels, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("step")
    left.set_title("each head's type at each snapshot", fontsize=9)
    for layer in range(L):
        for head in range(H):
            kind = history.final_type(layer, head)
            label = head_label(layer, head)
            if llc is not None and label in llc:
                steps, values = llc[label]
                ylabel = "weight-refined LLC"
            else:
                column = history.names.index(kind) if kind in history.names else None
                series = history.scores[:, layer, head]
                steps = x
                read = [history.names.index(name) for name in history.behaviours]
                values = series[:, column] if column is not None else np.nanmax(series[:, read], axis=-1)
                ylabel = "score at its final type's behaviour"
            at = np.searchsorted(x, steps, side="right") - 1
            types = history.types[np.clip(at, 0, len(x) - 1), layer, head]
            right.plot(steps, values, color="0.85", lw=0.8, zorder=1)
            right.scatter(steps, values, c=[behaviour_colour(type_names[t]) for t in types], s=6, zorder=2)
            right.annotate(label, (steps[-1], values[-1]), fontsize=6, xytext=(2, 0), textcoords="offset points")
    right.set_xlabel("step")
    right.set_ylabel(ylabel)
    right.set_title("each head over training, coloured by its type", fontsize=9)
    shown = sorted({type_names[t] for t in np.unique(history.types)}, key=type_names.index)
    handles = [plt.Line2D([], [], marker="s", ls="", color=behaviour_colour(name), label=name) for name in shown]
    right.legend(handles=handles, fontsize=7, loc="best")
    if clusters:
        table = axes[2]
        table.axis("off")
        kinds = sorted({history.final_type(l, h) for l in range(L) for h in range(H)}, key=type_names.index)
        groups = sorted(set(clusters.values()))

        def cell(c: int, kind: str) -> str:  # the heads of cluster c and type kind, two a line
            found = [
                label for label in labels if clusters.get(label) == c and history.final_type(*head_of(label)) == kind
            ]
            return "\n".join(", ".join(found[i : i + 2]) for i in range(0, len(found), 2)) or "·"

        cells = [[cell(c, kind) for kind in kinds] for c in groups]
        shown = table.table(cellText=cells, rowLabels=[f"cluster {c}" for c in groups], colLabels=kinds, loc="center")
        shown.auto_set_font_size(False)
        shown.set_fontsize(7)
        tallest = max(cell.count("\n") + 1 for row in cells for cell in row)
        shown.scale(1, 1 + 0.7 * (tallest - 1))
        table.set_title("clusters of the LLC curves against the final types", fontsize=9)
        table.text(0.5, 0.05, caption, ha="center", fontsize=8, transform=table.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
