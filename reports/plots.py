"""The end-of-run report's matplotlib figures: composition heatmaps and the score-over-training curves
(the heatmaps logged during training are drawn without matplotlib: :mod:`records.heatmap_pixels`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: runs on servers and in CI

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from metrics.dynamics.phase_change import PhaseChange
from records.heatmap_pixels import symmetric_limit

Series = tuple[np.ndarray, np.ndarray]  # (steps, values)


def composition_report(by_measure: dict[str, dict[str, np.ndarray]], title: str) -> Figure:
    """A row of labelled panels (one per kind) per measure, each row with its own symmetric colour
    limits and colour bar, since measures live on different scales. ``by_measure[m][kind]``:
    ``[L, H, L, H]``, NaN for masked pairs; rows writers, columns readers as in
    :func:`~records.heatmap_pixels.heatmap_image`.
    Small grids (<= 64 cells) print their values; big ones (> 16 heads a side) label layers, not heads."""
    n_rows = len(by_measure)
    n_cols = max(len(scores) for scores in by_measure.values())
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4.2 * n_cols + 1.2, 3.4 * n_rows), squeeze=False)
    height = 3.4 * n_rows  # margins in inches, whatever the rows; set before the colour bars take their room
    fig.subplots_adjust(top=1 - 0.8 / height, bottom=0.7 / height, right=0.9, hspace=0.25)
    first = next(iter(next(iter(by_measure.values())).values()))
    (x_ticks, x_labels), (y_ticks, y_labels), per_head = _pair_ticks(*first.shape[:2])
    for row, (measure, scores) in enumerate(by_measure.items()):
        limit = symmetric_limit(scores)
        image = None
        for col, (ax, kind) in enumerate(zip(axes[row], scores)):
            image = _composition_panel(ax, scores[kind], limit)
            ax.set_title(f"{measure} {kind}-composition".strip(), fontsize=10)
            # tick marks on every panel, labels on the outer ones only (not shared axes: keeping two dozen
            # axes' limits in step cost more than the labels saved, the same pixels 12 % slower)
            ax.set_xticks(x_ticks, x_labels if row == n_rows - 1 else [])
            ax.set_yticks(y_ticks, y_labels if col == 0 else [])
            ax.tick_params(labelsize=7)
            ax.tick_params(axis="x", labelrotation=90 if per_head else 0)
        for ax in axes[row][len(scores) :]:
            ax.set_visible(False)
        axes[row][0].set_ylabel("writer")
        if image is not None:
            fig.colorbar(image, ax=axes[row].tolist(), shrink=0.8)
    for ax in axes[-1]:
        ax.set_xlabel("reader")
    fig.suptitle(title, y=1 - 0.3 / (3.4 * n_rows))
    return fig


def _pair_ticks(L: int, H: int) -> tuple[tuple, tuple, bool]:
    """The pair panels' ``(x ticks, labels)`` (readers) and ``(y ticks, labels)`` (writers): every head on
    small grids (<= 16 a side; then True), else every layer, labelled at the middle of its block."""
    side = (L - 1) * H
    labels = [f"L{l}H{h}" for l in range(L) for h in range(H)]
    if side <= 16:
        return (range(side), labels[H:]), (range(side), labels[:side]), True
    middles = np.arange(L - 1) * H + (H - 1) / 2
    return (middles, [f"L{l}" for l in range(1, L)]), (middles, [f"L{l}" for l in range(L - 1)]), False


def _composition_panel(ax, scores: np.ndarray, limit: float):
    """Draw ``scores [L, H, L, H]`` as writers x readers on ``ax`` (ticks: :func:`_pair_ticks`);
    returns the image (for a colour bar)."""
    L, H = scores.shape[:2]
    side = (L - 1) * H
    grid = scores.reshape(L * H, L * H)[:side, H:]  # writers x readers
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
    for boundary in np.arange(H, side, H) - 0.5:  # lines between layers
        ax.axhline(boundary, color="0.35", lw=0.6)
        ax.axvline(boundary, color="0.35", lw=0.6)
    ax.set_facecolor("0.85")
    if grid.size <= 64:  # small grids: print the values
        for (row, col), value in np.ndenumerate(grid):
            if np.isfinite(value):
                shade = "white" if abs(value) > 0.6 * limit else "black"
                ax.text(col, row, f"{value:+.3f}", ha="center", va="center", fontsize=7, color=shade)
    return image


class DrawnAside:
    """``draw()`` (build a figure and save it) in a forked child process while this one goes on, so that
    a report's figures take every core there is; :meth:`done` says whether it is drawn, and draws here
    after all if the child failed (or where there is no fork, or one core). The child runs torch on one thread,
    writes only its figure and leaves by ``os._exit``: nothing of the parent's (W&B, files) is flushed
    or closed twice."""

    def __init__(self, draw: Callable[[], None]) -> None:
        self.draw, self.pid = draw, None
        if sys.platform.startswith("linux") and usable_cores() > 1:  # fork is unsafe on macOS
            sys.stdout.flush()
            sys.stderr.flush()
            self.pid = os.fork()
            if self.pid == 0:  # the child
                code = 1
                try:
                    if (torch := sys.modules.get("torch")) is not None:
                        # the parent's OpenMP threads are not in the child: an OpenMP team of more than
                        # one (a figure's smoothing by conv1d) would wait for them for ever
                        torch.set_num_threads(1)
                    draw()
                    code = 0
                finally:
                    os._exit(code)

    def done(self) -> bool:
        """Whether it is drawn (without waiting: a child still drawing is False; one that failed is
        drawn here, then True)."""
        if self.pid is None:
            self.draw()
            return True
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.pid = None
        if status != 0:
            self.draw()
        return True


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def draw_figures(drawings: list[tuple[Callable[[], Figure], Path]], then: Callable[[], None] = lambda: None) -> None:
    """Build and save each ``(build, path)`` figure (:func:`save_figure`), each in a forked child
    (:class:`DrawnAside`), all forked at once, before ``then()`` runs here meanwhile: ``then`` may start
    threads (the explorer page), and no fork follows one. One core, or no fork: one after the other,
    here, then ``then()``. A report's five figures are each CPU-bound (text layout, rasterising, PNG
    encoding) and independent: n cores draw them in about 1/n of their CPU time, or the dearest one's."""
    drawing = [DrawnAside(partial(draw_and_save, build, path)) for build, path in drawings]
    then()
    while drawing:
        drawing = [aside for aside in drawing if not aside.done()]
        if drawing:
            time.sleep(0.005)


def draw_and_save(build: Callable[[], Figure], path: Path) -> None:
    """Build a figure and save it (:func:`save_figure`)."""
    save_figure(build(), path)


def save_figure(fig: Figure, path: Path) -> None:
    """Save ``fig`` as a report's figure (PNG, 110 dpi) and close it without drawing it again."""
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mark_phase_change(ax, change: PhaseChange | None) -> None:
    if change is None:
        return
    ax.axvspan(change.onset_step, change.span_end, color="tab:orange", alpha=0.15, lw=0)
    ax.axvline(change.midpoint_step, color="tab:orange", ls="--", lw=1)


Window = tuple[int, "int | None", str]
"""A training-time intervention's ``(from_step, until_step or None: to the end, label)``."""


def mark_interventions(ax, windows: list[Window] | None, last_step: float, legend: bool = False) -> None:
    """Each intervention's window, grey and hatched (the phase change is orange), labelled in the legend with ``legend``."""
    for start, end, label in windows or []:
        ax.axvspan(
            start,
            last_step if end is None else end,
            color="0.5",
            alpha=0.12,
            hatch="//",
            lw=0,
            label=f"intervention: {label}" if legend else None,
            zorder=0,
        )


def training_curves(
    loss_first: Series,
    loss_repeated: Series,
    top_induction: Series,
    top_prev_token: Series,
    circuit_raw: Series | None,
    circuit_minus_baseline: Series | None,
    other_pairs_minus_baseline: list[Series],
    baseline: float | None,
    change: PhaseChange | None,
    title: str,
    measure: str = "frobenius",
    other_pairs_label: str = "other pairs, minus baseline",
    other_pairs_band: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    shares: dict[str, Series] | None = None,
    interventions: list[Window] | None = None,
    intervention_off: dict[str, Series] | None = None,
    reader: str = "induction",
) -> Figure:
    """Stacked panels sharing the step axis, the phase change shaded on each: the losses, the head
    scores, the circuit pair's K-composition and, with ``shares``, what the circuit's reader's keys
    read on the probe (the data-aware K share: ``{"writer": ..., "tokens": ..., "positions": ...}``).

    ``other_pairs_minus_baseline``: grey curves, drawn as one collection (thousands stay cheap);
    ``other_pairs_band``: ``(steps, low, high)`` shaded behind them, e.g. the range over every pair
    when only some are drawn. ``interventions``: ``(from_step, until_step or None, label)`` windows,
    shaded on every panel; ``intervention_off``: the loss and top head scores measured with them off
    (keys ``loss/repeated``, ``heads/prev_token/top``, ``heads/induction/top``), drawn dotted. ``reader``:
    the task's prefix-matching behaviour, whose top score ``top_induction`` is (``statistical_induction`` on chains)."""
    panels = 4 if shares else 3
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3 * panels), sharex=True)
    ax_loss, ax_heads, ax_comp = axes[:3]
    ax_loss.plot(*loss_first, label="first occurrences", color="tab:gray")
    ax_loss.plot(*loss_repeated, label="repeated tokens", color="tab:blue")
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.legend(loc="upper right")
    ax_heads.plot(*top_induction, label=f"top {reader.replace('_', ' ')} score", color="tab:red")
    ax_heads.plot(*top_prev_token, label="top previous-token score", color="tab:green")
    off = intervention_off or {}
    for key, ax, colour, label in (
        ("loss/repeated", ax_loss, "tab:blue", "repeated tokens, intervention off"),
        ("heads/induction/top", ax_heads, "tab:red", "top induction, intervention off"),
        ("heads/prev_token/top", ax_heads, "tab:green", "top previous-token, intervention off"),
    ):
        if key in off:
            ax.plot(*off[key], color=colour, ls=":", lw=1.4, label=label)
    ax_heads.set_ylabel("attention score")
    ax_heads.set_ylim(-0.02, 1.02)
    ax_heads.legend(loc="center right")
    if other_pairs_band is not None:
        ax_comp.fill_between(*other_pairs_band, color="0.9", lw=0, label="range over all pairs, minus baseline")
    if other_pairs_minus_baseline:
        curves = LineCollection(
            [np.column_stack(pair) for pair in other_pairs_minus_baseline],
            colors="0.75",
            linewidths=0.8,
            label=other_pairs_label,
        )
        ax_comp.add_collection(curves)
        ax_comp.autoscale_view()
    if circuit_raw is not None:
        ax_comp.plot(*circuit_raw, color="tab:purple", label="circuit pair K-comp (raw)")
        ax_comp.plot(*circuit_minus_baseline, color="tab:purple", ls="--", label="circuit pair K-comp minus baseline")
    if circuit_raw is None and not other_pairs_minus_baseline and other_pairs_band is None:
        ax_comp.text(
            0.5,
            0.5,
            "no composition: one layer has no earlier->later head pairs",
            transform=ax_comp.transAxes,
            ha="center",
            va="center",
            color="0.4",
        )
    if baseline is not None:
        ax_comp.axhline(baseline, color="k", lw=0.8, ls=":", label=f"random baseline {baseline:.3f}")
    ax_comp.set_ylabel(f"K-composition ({measure})")
    ax_comp.legend(loc="upper left", fontsize=8)
    if shares:
        ax_share = axes[3]
        style = {"writer": ("tab:purple", "-"), "tokens": ("tab:gray", "--"), "positions": ("tab:brown", ":")}
        for part, series in shares.items():
            colour, line = style.get(part, ("k", "-"))
            label = "the circuit's writer" if part == "writer" else f"{part} (the rest)"
            ax_share.plot(*series, color=colour, ls=line, label=label)
        ax_share.axhline(0, color="k", lw=0.6)
        ax_share.set_ylabel("share of the reader's\nK scores on the probe")
        ax_share.legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("training step")
    last_step = float(loss_repeated[0][-1]) if len(loss_repeated[0]) else 0.0
    for ax in axes:
        mark_phase_change(ax, change)
        mark_interventions(ax, interventions, last_step, legend=ax is ax_loss)
        ax.grid(alpha=0.3)
    if interventions or off:
        ax_loss.legend(loc="upper right", fontsize=7)
        ax_heads.legend(loc="center right", fontsize=7)
    if change is None:
        ax_loss.set_title("no phase change: no sharp transition in the repeated-token loss", fontsize=9)
    else:
        ax_loss.set_title(
            f"phase change in the repeated-token loss: onset {change.onset_step:.0f}, "
            f"midpoint {change.midpoint_step:.0f}, "
            + (
                f"end {change.end_step:.0f}" if change.finished else f"end beyond the run (step {change.last_step:.0f})"
            ),
            fontsize=9,
        )
    fig.suptitle(title)
    fig.tight_layout()
    return fig
