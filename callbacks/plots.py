"""Matplotlib figures: composition heatmaps and the score-over-training curves."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: runs on servers and in CI

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from metrics.dynamics.phase_change import PhaseChange

Series = tuple[np.ndarray, np.ndarray]  # (steps, values)


def composition_heatmaps(scores: dict[str, np.ndarray], title: str) -> Figure:
    """One panel per kind; ``scores[kind]`` is ``[n_layers, n_heads, n_layers, n_heads]`` with NaN
    for masked pairs. Rows are writer heads (all but the last layer), columns reader heads."""
    kinds = list(scores)
    L, H = next(iter(scores.values())).shape[:2]
    labels = [f"L{l}H{h}" for l in range(L) for h in range(H)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.8), squeeze=False)
    finite = np.concatenate([s[np.isfinite(s)] for s in scores.values()])
    limit = float(np.abs(finite).max()) if finite.size else 1.0
    for ax, kind in zip(axes[0], kinds):
        grid = scores[kind].reshape(L * H, L * H)[: (L - 1) * H, H:]  # writers x readers
        image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set_title(f"{kind}-composition")
        ax.set_xticks(range(grid.shape[1]), labels[H:], rotation=90, fontsize=7)
        ax.set_yticks(range(grid.shape[0]), labels[: (L - 1) * H], fontsize=7)
        ax.set_xlabel("reader")
        ax.set_facecolor("0.85")
        if grid.size <= 64:  # small grids: print the values
            for (row, col), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    shade = "white" if abs(value) > 0.6 * limit else "black"
                    ax.text(col, row, f"{value:+.3f}", ha="center", va="center", fontsize=7, color=shade)
    axes[0][0].set_ylabel("writer")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(title)
    return fig


def figure_to_rgb(fig: Figure) -> np.ndarray:
    """Render ``fig`` to an ``[height, width, 3]`` uint8 array and close it."""
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return rgb


def mark_phase_change(ax, change: PhaseChange | None) -> None:
    if change is None:
        return
    ax.axvspan(change.onset_step, change.end_step, color="tab:orange", alpha=0.15, lw=0)
    ax.axvline(change.midpoint_step, color="tab:orange", ls="--", lw=1)


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
) -> Figure:
    """Three stacked panels sharing the step axis, the phase change shaded on each."""
    fig, (ax_loss, ax_heads, ax_comp) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax_loss.plot(*loss_first, label="first occurrences", color="tab:gray")
    ax_loss.plot(*loss_repeated, label="repeated tokens", color="tab:blue")
    ax_loss.set_ylabel("loss (nats)")
    ax_loss.legend(loc="upper right")
    ax_heads.plot(*top_induction, label="top induction score", color="tab:red")
    ax_heads.plot(*top_prev_token, label="top previous-token score", color="tab:green")
    ax_heads.set_ylabel("attention score")
    ax_heads.set_ylim(-0.02, 1.02)
    ax_heads.legend(loc="center right")
    for i, pair in enumerate(other_pairs_minus_baseline):
        ax_comp.plot(*pair, color="0.75", lw=0.8, label="other pairs, minus baseline" if i == 0 else None)
    if circuit_raw is not None:
        ax_comp.plot(*circuit_raw, color="tab:purple", label="circuit pair K-comp (raw)")
        ax_comp.plot(*circuit_minus_baseline, color="tab:purple", ls="--", label="circuit pair K-comp minus baseline")
    if circuit_raw is None and not other_pairs_minus_baseline:
        ax_comp.text(0.5, 0.5, "no composition: one layer has no earlier->later head pairs",
                     transform=ax_comp.transAxes, ha="center", va="center", color="0.4")
    if baseline is not None:
        ax_comp.axhline(baseline, color="k", lw=0.8, ls=":", label=f"random baseline {baseline:.3f}")
    ax_comp.set_ylabel(f"K-composition ({measure})")
    ax_comp.set_xlabel("training step")
    ax_comp.legend(loc="upper left", fontsize=8)
    for ax in (ax_loss, ax_heads, ax_comp):
        mark_phase_change(ax, change)
        ax.grid(alpha=0.3)
    if change is None:
        ax_loss.set_title("no phase change: no sharp transition in the repeated-token loss", fontsize=9)
    else:
        ax_loss.set_title(
            f"phase change in the repeated-token loss: onset {change.onset_step:.0f}, "
            f"midpoint {change.midpoint_step:.0f}, end {change.end_step:.0f}",
            fontsize=9,
        )
    fig.suptitle(title)
    fig.tight_layout()
    return fig
