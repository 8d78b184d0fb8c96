"""Figures of developmental stages: every signal on one step axis with the stages shaded, and the
essential-dynamics trajectory in its principal components (Hoogland et al. 2024, Figs. 1-2)."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from metrics.dynamics.phase_change import PhaseChange
from metrics.dynamics.stages import EssentialDynamics, TurningPoint
from reports.plots import mark_phase_change, plt

Series = tuple[np.ndarray, np.ndarray]
SOURCE_COLOURS = {"llc": "tab:red", "PC1": "tab:blue", "PC2": "tab:green", "PC3": "tab:olive"}


def shade_stages(ax, boundaries: list[float], last_step: float) -> None:
    """Alternate light bands between consecutive boundaries (stage 1 unshaded)."""
    edges = [0.0, *boundaries, last_step]
    for i, (left, right) in enumerate(zip(edges, edges[1:], strict=False)):
        if i % 2:
            ax.axvspan(left, right, color="0.92", lw=0, zorder=0)


def stages_figure(
    llc: dict[str, Series],
    llc_std: Series | None,
    series: dict[str, Series],
    measures: list[str],
    boundaries: list[TurningPoint],
    change: PhaseChange | None,
    title: str,
) -> Figure:
    """Five panels sharing the step axis: the LLC (``llc``: label -> (steps, λ̂), the model's first,
    each circuit head's after; a cross where the model's chain diverged), the repeated-token loss,
    the circuit pair's K-composition under ``measures`` (each rescaled to [0, 1] over the run), its
    ablation loss change, and the top induction score. Boundaries are vertical lines coloured by source; stages alternate shading;
    the phase change (onset-end) is the orange band."""
    fig, axes = plt.subplots(5, 1, figsize=(9, 12), sharex=True)
    ax_llc, ax_loss, ax_comp, ax_abl, ax_ind = axes
    for i, (label, (steps, values)) in enumerate(llc.items()):
        ax_llc.plot(steps, values, marker=".", ms=3, color="tab:red" if i == 0 else None, label=label)
    model_steps, model_llc = next(iter(llc.values())) if llc else (np.array([]), np.array([]))
    if llc_std is not None and llc:
        ax_llc.fill_between(
            model_steps, model_llc - llc_std[1], model_llc + llc_std[1], color="tab:red", alpha=0.2, lw=0
        )
    diverged = model_steps[np.isnan(model_llc)]  # where the model's chain diverged: a cross on the axis
    if len(diverged):
        ax_llc.scatter(
            diverged,
            np.full(len(diverged), 0.03),
            transform=ax_llc.get_xaxis_transform(),
            marker="x",
            color="k",
            label="diverged (no λ̂)",
        )
    ax_llc.set_ylabel("LLC λ̂")
    if llc:
        ax_llc.legend(loc="upper left", fontsize=8)
    else:
        ax_llc.text(0.5, 0.5, "LLC not estimated", transform=ax_llc.transAxes, ha="center", color="0.4")
    panels = (
        (ax_loss, ["loss/repeated", "loss/first_occurrence"], "loss (nats)"),
        (ax_abl, ["circuit/ablation/loss_change"], "ablation loss change"),
        (ax_ind, ["heads/induction/top", "heads/prev_token/top"], "attention score"),
    )
    for ax, keys, label in panels:
        for key in keys:
            if key in series:
                ax.plot(*series[key], label=key)
        ax.set_ylabel(label)
        ax.legend(loc="best", fontsize=8)
    for measure in measures:
        key = f"circuit/K/{measure}"
        if key in series:
            steps, values = series[key]
            span = np.nanmax(values) - np.nanmin(values)
            ax_comp.plot(steps, (values - np.nanmin(values)) / (span or 1.0), lw=1, label=measure)
    ax_comp.set_ylabel("circuit pair K\n(each measure: min-max over the run)")
    ax_comp.legend(loc="best", fontsize=7, ncol=2)
    last = max([float(s[-1]) for s, _ in [*llc.values(), *series.values()] if len(s)] or [1.0])
    steps_at = sorted({p.step for p in boundaries})
    for ax in axes:
        shade_stages(ax, steps_at, last)
        mark_phase_change(ax, change)
        for point in boundaries:
            ax.axvline(point.step, color=SOURCE_COLOURS.get(point.source, "k"), lw=0.9, ls=":")
        ax.grid(alpha=0.3)
    ax_ind.set_xlabel("training step")
    described = ", ".join(f"{p.step:.0f} ({p.source} {p.kind})" for p in boundaries) or "none"
    ax_llc.set_title(f"turning points: {described}", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def essential_dynamics_figure(dynamics: EssentialDynamics, boundaries: list[TurningPoint], title: str) -> Figure:
    """The trajectory in PC1-PC2 (and PC2-PC3 when there is a third), coloured by step, the
    essential-dynamics turning points ringed."""
    k = dynamics.coords.shape[1]
    pairs = [(0, 1), (1, 2)][: max(1, k - 1)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.8), squeeze=False)
    steps, coords = dynamics.steps.numpy(), dynamics.coords.numpy()
    turns = [p for p in boundaries if p.source.startswith("PC")]
    for ax, (a, b) in zip(axes[0], pairs, strict=False):
        ax.plot(coords[:, a], coords[:, b], color="0.7", lw=0.8, zorder=1)
        points = ax.scatter(coords[:, a], coords[:, b], c=steps, cmap="viridis", s=14, zorder=2)
        for point in turns:
            i = int(np.argmin(np.abs(steps - point.step)))
            ax.scatter(coords[i, a], coords[i, b], s=90, facecolors="none", edgecolors="tab:red", zorder=3)
            ax.annotate(
                f"{point.step:.0f}", (coords[i, a], coords[i, b]), fontsize=7, xytext=(4, 4), textcoords="offset points"
            )
        ax.set_xlabel(f"PC{a + 1} ({100 * float(dynamics.explained[a]):.0f}% of variance)")
        ax.set_ylabel(f"PC{b + 1} ({100 * float(dynamics.explained[b]):.0f}% of variance)")
        ax.grid(alpha=0.3)
    fig.colorbar(points, ax=axes[0, -1], label="training step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
