"""Figures of developmental stages: every signal on one step axis with each boundary and its
interval, and the essential-dynamics trajectory in its principal components (Hoogland et al. 2024,
Figs. 1-2)."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from metrics.dynamics.phase_change import PhaseChange
from metrics.dynamics.stages import DYNAMICS_SOURCE, LLC_SOURCE, Boundary, EssentialDynamics
from reports.plots import Window, mark_interventions, mark_phase_change, plt

Series = tuple[np.ndarray, np.ndarray]
SOURCE_COLOURS = {LLC_SOURCE: "tab:red", DYNAMICS_SOURCE: "tab:blue"}


def shade_stages(ax, boundaries: list[float], last_step: float) -> None:
    """Alternate light bands between consecutive boundaries (stage 1 unshaded)."""
    edges = [0.0, *boundaries, last_step]
    for i, (left, right) in enumerate(zip(edges, edges[1:], strict=False)):
        if i % 2:
            ax.axvspan(left, right, color="0.95", lw=0, zorder=0)


def mark_boundaries(ax, boundaries: list[Boundary]) -> None:
    """Each boundary as a dotted line in its source's colour, its interval (where 90 % of the
    resamples put it) as a band of that colour."""
    for b in boundaries:
        colour = SOURCE_COLOURS.get(b.source, "k")
        if np.isfinite(b.low) and np.isfinite(b.high):
            ax.axvspan(min(b.low, b.step), max(b.high, b.step), color=colour, alpha=0.12, lw=0, zorder=0)
        ax.axvline(b.step, color=colour, lw=0.9, ls=":")


def describe(b: Boundary) -> str:
    interval = f" [{b.low:.0f}-{b.high:.0f}]" if np.isfinite(b.low) else ""
    return f"{b.step:.0f}{interval} {'LLC' if b.source == LLC_SOURCE else 'ED'} {b.kind}"


def stages_figure(
    llc: dict[str, Series],
    llc_std: Series | None,
    smoothed: Series | None,
    series: dict[str, Series],
    measures: list[str],
    boundaries: list[Boundary],
    change: PhaseChange | None,
    title: str,
    interventions: list[Window] | None = None,
) -> Figure:
    """Five panels sharing the step axis: the LLC (``llc``: label -> (steps, λ̂), the model's first,
    each circuit head's after; the chains' spread as a band; ``smoothed``, the curve its boundaries
    are read from, dashed; a cross where the model's chain diverged), the repeated-token loss, the
    circuit pair's K-composition under ``measures`` (each rescaled to [0, 1] over the run), its
    ablation loss change, and the top induction score. Boundaries are vertical lines coloured by
    source (red: LLC, blue: essential dynamics) with their intervals as bands; stages alternate
    shading; the phase change (onset-end) is the orange band; ``interventions``' windows are hatched."""
    fig, axes = plt.subplots(5, 1, figsize=(9, 12), sharex=True)
    ax_llc, ax_loss, ax_comp, ax_abl, ax_ind = axes
    for i, (label, (steps, values)) in enumerate(llc.items()):
        ax_llc.plot(steps, values, marker=".", ms=3, color="tab:red" if i == 0 else None, label=label)
    model_steps, model_llc = next(iter(llc.values())) if llc else (np.array([]), np.array([]))
    if llc_std is not None and llc:
        ax_llc.fill_between(
            model_steps, model_llc - llc_std[1], model_llc + llc_std[1], color="tab:red", alpha=0.2, lw=0
        )
    if smoothed is not None:
        ax_llc.plot(*smoothed, color="k", lw=0.8, ls="--", label="model, smoothed (local linear in ln step)")
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
        ax_llc.legend(loc="center right", fontsize=8)
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
    for ax in axes:
        shade_stages(ax, sorted({b.step for b in boundaries}), last)
        mark_phase_change(ax, change)
        mark_interventions(ax, interventions, last)
        mark_boundaries(ax, boundaries)
        ax.grid(alpha=0.3)
    ax_ind.set_xlabel("training step")
    described = "; ".join(describe(b) for b in boundaries) or "none survives its null"
    ax_llc.set_title(f"boundaries [90 % of resamples]: {described}", fontsize=8, wrap=True)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def essential_dynamics_figure(dynamics: EssentialDynamics, boundaries: list[Boundary], title: str) -> Figure:
    """The trajectory in PC1-PC2 (and PC2-PC3 when there is a third), coloured by step, the
    essential-dynamics boundaries ringed (at the first step after each); the axis labels say which
    components beat the parallel-analysis null."""
    k = dynamics.coords.shape[1]
    pairs = [(0, 1), (1, 2)][: max(1, k - 1)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.8), squeeze=False)
    steps, coords = dynamics.steps.numpy(), dynamics.coords.numpy()
    shifts = [b for b in boundaries if b.source == DYNAMICS_SOURCE]
    label = lambda c: (
        f"PC{c + 1} ({100 * float(dynamics.explained[c]):.0f}% of variance"
        + ("" if c < dynamics.significant else "; not above the null")
        + ")"
    )
    for ax, (a, b) in zip(axes[0], pairs, strict=False):
        ax.plot(coords[:, a], coords[:, b], color="0.7", lw=0.8, zorder=1)
        points = ax.scatter(coords[:, a], coords[:, b], c=steps, cmap="viridis", s=14, zorder=2)
        for shift in shifts:
            i = int(np.searchsorted(steps, shift.step))
            ax.scatter(coords[i, a], coords[i, b], s=90, facecolors="none", edgecolors="tab:red", zorder=3)
            ax.annotate(
                describe(shift), (coords[i, a], coords[i, b]), fontsize=7, xytext=(4, 4), textcoords="offset points"
            )
        ax.set_xlabel(label(a))
        ax.set_ylabel(label(b))
        ax.grid(alpha=0.3)
    fig.colorbar(points, ax=axes[0, -1], label="training step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
