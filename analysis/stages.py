"""Developmental stages of a finished run, from its saved weights: the local learning coefficient
(LLC) and the essential dynamics over the trajectory, their turning points, and how those compare
with the phase change.

    python -m analysis.stages RUN_DIR
    python -m analysis.stages RUN_DIR stages.llc.heads=false --every 2
    python -m analysis.stages RUN_DIR stages.llc_enabled=false        # essential dynamics only
    python -m analysis.stages multirun/2026-11-24/10-00-00              # every job, then the sweep report

At every selected saved step (``RUN_DIR/trajectory/``):

- the LLC λ̂ by SGLD (:mod:`metrics.dynamics.llc`, devinterp: the ``llc`` extra) on
  ``stages.llc.batches × batch_size`` held-out sequences of the run's own training distribution,
  with its chain spread and whether its loss trace settled; with ``stages.llc.heads`` also the
  weight-refined λ̂ of every head and every layer (Wang et al. 2024), all in one batched SGLD run
  (:mod:`metrics.dynamics.refined_llc`), and with ``stages.llc.data_refined`` their data-refined λ̂
  on each named component of a mixture task;
- the per-token losses on ``stages.sequences`` fixed held-out sequences: the essential dynamics
  (:mod:`metrics.dynamics.stages`) are their principal components over the trajectory.

Stage boundaries are where each signal changes, every one tested against a null
(:mod:`metrics.dynamics.stages`). Outputs, under ``RUN_DIR/analysis/NAME/`` (``stages`` unless
``--name``), through :mod:`analysis.protocol`: ``llc.csv``, ``essential_dynamics.csv``,
``stages.png`` (every signal on one step axis, boundaries with their intervals),
``essential_dynamics.png``, a W&B run (``job_type=analysis``) in the run's group with the curves and
both figures, and ``analysis.json`` (its ``result``: boundaries, the phase change, settings, wall
times). An existing analysis is kept unless ``--overwrite``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from analysis.protocol import Analysis, Conclusion, main
from analysis.saved_run import Request
from conf.objects import held_out_sequences, llc_sequences, sgld_settings, stage_settings
from conf.validate import llc_calibration_warning, stages_problems
from metrics.dynamics.llc import LLCUnavailable, require_devinterp
from metrics.dynamics.stages import MIN_STEPS, Boundary, boundary_columns
from records.layout import (
    CSV_RELATIVE_PATH,
    ESSENTIAL_DYNAMICS_FIGURE,
    ESSENTIAL_DYNAMICS_TABLE,
    LLC_TABLE,
    STAGES_FIGURE,
    SUMMARY_NAME,
)

BOUNDARY_KEYS = ("step", "source", "kind", "low", "high", "support", "statistic")
"""What W&B's summary keeps of each boundary, one list a key (``stages/boundary_step``, ...)."""


class Stages(Analysis):
    """The LLC (and each circuit head's) and the per-token losses at each step; the boundaries of both."""

    kind = "stages"
    section = "stages"
    example = "stages.llc.lr=3e-4"
    table = LLC_TABLE
    min_steps = 3
    columns_title = (
        "stage boundaries (step (90 % of resamples, share of resamples): source kind; python -m analysis.stages)"
    )
    request_errors = (LLCUnavailable,)

    @classmethod
    def check(cls, cfg: DictConfig, options: dict) -> list[str]:
        problems = stages_problems(cfg.stages)
        if not problems and cfg.stages.llc_enabled:
            require_devinterp()
        return problems + data_refined_problems(cfg)

    def __init__(self, request: Request) -> None:
        super().__init__(request)
        self.stages = stages = request.cfg.stages
        shape = request.cfg.model
        every_head = [(layer, head) for layer in range(shape.n_layers) for head in range(shape.n_heads)]
        self.heads = every_head if stages.llc_enabled and stages.llc.heads else []
        self.data_refined = list(stages.llc.data_refined) if stages.llc_enabled else []

    def describe(self) -> str:
        parts = ["essential dynamics"]
        if self.stages.llc_enabled:
            s = sgld_settings(self.stages.llc)
            parts.insert(
                0, f"LLC ({s.chains} chains × {s.draws} draws, ε {s.lr:g}, γ {s.localization:g}, nβ {s.n_beta:.3g})"
            )
        if self.heads:
            parts.insert(1, f"the weight-refined LLC of every head and layer ({len(self.heads)} heads, one batch)")
        if self.data_refined:
            parts.insert(2, "their data-refined LLC on " + ", ".join(self.data_refined))
        return ", ".join(parts)

    def settings(self) -> dict:
        """What a step's measurements depend on (not how the curves are read afterwards)."""
        llc = {k: v for k, v in OmegaConf.to_container(self.stages.llc, resolve=True).items() if k != "every_n_steps"}
        return {
            "llc_enabled": self.stages.llc_enabled,
            "llc": llc,
            "sequences": self.stages.sequences,
            "heads": [list(h) for h in self.heads],
            "data_refined": self.data_refined,
            "row": "per-chain",  # rows carry each chain's λ̂ (llc_chain_*): older measurements do not
        }

    def start(self, loggers: list) -> None:
        cfg, stages = self.cfg, self.stages
        if stages.llc_enabled and (warning := llc_calibration_warning(cfg)):
            print(warning, file=sys.stderr)
        device = self.request.torch_device
        self.llc_rows = llc_sequences(cfg).to(device)
        self.probe = held_out_sequences(cfg, stages.sequences, offset=stages.llc.batches * stages.llc.batch_size).to(
            device
        )
        count = stages.llc.batches * stages.llc.batch_size
        self.refined_rows = {name: component_sequences(cfg, name, count).to(device) for name in self.data_refined}

    def measure(self, step: int, model) -> tuple[dict, dict[str, torch.Tensor]]:
        """llc.csv's row (λ̂ of the model; with ``heads`` of every head ``llc_LxHy`` and layer ``llc_Lx``,
        each with ``_std`` and ``_diverged``; data-refined ``llc_on_NAME_LxHy``) and the per-token losses
        ``[sequences * (seq_len - 1)]`` on the held-out probe."""
        from callbacks.tracker import openmp_threads

        threads = self.cfg.tracker.num_threads  # torch threads while measuring, as the tracker's
        with openmp_threads(int(threads) if threads else torch.get_num_threads()):
            return self.measure_with_threads_set(model)

    def measure_with_threads_set(self, model) -> tuple[dict, dict[str, torch.Tensor]]:
        from metrics.dynamics.llc import llc_record, per_position_losses
        from metrics.dynamics.refined_llc import refined_llcs

        row: dict[str, float] = {}
        if self.stages.llc_enabled:
            settings, tolerance = sgld_settings(self.stages.llc), self.stages.llc.settle_tolerance
            if not self.heads:
                row.update({f"llc_{k}": v for k, v in llc_record(model, self.llc_rows, settings, tolerance).items()})
            else:  # the model, every head and every layer: one batch
                records = refined_llcs(model, self.llc_rows, settings, tolerance, ("model", "heads", "layers"))
                row.update({f"llc_{k}": v for k, v in records.pop("model").items()})
                row.update(group_columns("llc_", records))
            for name, rows in self.refined_rows.items():
                records = refined_llcs(model, rows, settings, tolerance, ("heads", "layers"))
                row.update(group_columns(f"llc_on_{name}_", records))
        with torch.no_grad():
            losses = per_position_losses(model, self.probe).flatten()
        return row, {"losses": losses.cpu()}

    def describe_row(self, row: dict) -> str:
        if "llc_mean" not in row:
            return "losses"
        heads = [name for name in diverged_estimates(row) if name != "model"]
        also = f"; λ̂ of {', '.join(heads)} DIVERGED" if heads else ""
        if row["llc_diverged"]:
            return f"λ̂ DIVERGED (a non-finite loss) after {row['llc_seconds']:.1f} s{also}"
        settled = "" if row["llc_settled"] else f" NOT SETTLED (drift {row['llc_drift']:+.2f})"
        return f"λ̂ {row['llc_mean']:.2f} ± {row['llc_std']:.2f} in {row['llc_seconds']:.1f} s{settled}{also}"

    def conclude(self, rows: list[dict], tensors: list[dict]) -> Conclusion:
        """The boundaries of the LLC and of the essential dynamics, with the tables, figures and summary."""
        from metrics.dynamics.stages import stage_boundaries
        from reports.run_report import read_series

        request, stages = self.request, self.stages
        steps_t = torch.tensor(request.steps, dtype=torch.float64)
        losses = torch.stack([t["losses"] for t in tensors])
        llc = (steps_t, chain_estimates(rows)) if stages.llc_enabled else None
        boundaries, dynamics, states = stage_boundaries(
            llc, (steps_t, losses), stage_settings(stages), stages.components
        )
        kept = [b for b in boundaries if b.kept]
        summary_path = request.run_dir / SUMMARY_NAME
        run_summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        change = {part: run_summary.get(f"phase_change/loss_{part}_step") for part in ("onset", "midpoint", "end")}
        switches = strategy_switches(run_summary)
        diverged = {str(r["step"]): diverged_estimates(r) for r in rows if diverged_estimates(r)}  # step: which
        result = {
            "stages": OmegaConf.to_container(stages, resolve=True),
            "n_beta": sgld_settings(stages.llc).n_beta,
            "heads": [f"L{layer}H{head}" for layer, head in self.heads],
            "head_types": (agreement := head_type_agreement(request, rows, self.heads, self.data_refined)),
            "boundaries": [asdict(b) for b in kept],
            "weak_boundaries": [asdict(b) for b in boundaries if not b.kept],  # found, but in too few resamples
            "phase_change": change,
            "nearest_phase_change": [nearest(b.step, change) for b in kept],
            "strategy_switches": switches,
            "nearest_switch": [nearest_switch(b, switches) for b in kept],
            "explained_variance": dynamics.explained.tolist(),
            "significant_components": dynamics.significant,
            "llc_band": states.q if states is not None else None,
            "llc_seconds_per_estimate": seconds_per_estimate(rows),
            "unsettled_steps": [
                r["step"] for r in rows if stages.llc_enabled and not r["llc_settled"] and not r["llc_diverged"]
            ],
            "diverged": diverged,
        }
        coords = {
            step: {f"PC{c + 1}": float(v) for c, v in enumerate(at)}
            for step, at in zip(request.steps, dynamics.coords, strict=True)
        }
        csv_path = request.run_dir / CSV_RELATIVE_PATH
        series = read_series(csv_path) if csv_path.is_file() else {}
        return Conclusion(
            result=result,
            tables={ESSENTIAL_DYNAMICS_TABLE: [{"step": step, **at} for step, at in coords.items()]},
            figures={
                **draw(rows, self.heads, series, dynamics, kept, states, change, self.cfg, request),
                **heads_with_llc(request, rows, self.heads, agreement),
            },
            curves=coords,
            summary={
                **{f"stages/boundary_{key}": [asdict(b)[key] for b in kept] for key in BOUNDARY_KEYS},
                "stages/significant_components": dynamics.significant,
                **head_type_summary(agreement),
            },
            columns=boundary_columns(result["boundaries"]),
            incomplete=bool(diverged),
        )

    def report(self, conclusion: Conclusion) -> None:
        print_stages(conclusion.result)


def head_type_summary(agreement: dict | None) -> dict[str, object]:
    """``stages/heads/NAME/ari`` (and ``_p``) for the weight-refined curves and each data-refined set,
    and ``stages/llc/LxHy/final`` (each head's last weight-refined λ̂)."""
    if agreement is None:
        return {}
    summary: dict[str, object] = {}
    for name, found in agreement.items():
        if name != "types" and "ari" in found:
            summary[f"stages/heads/{name}/ari"] = found["ari"]
            summary[f"stages/heads/{name}/ari_p"] = found["ari_p"]
    for label, value in agreement.get("weight_refined", {}).get("final", {}).items():
        summary[f"stages/llc/{label}/final"] = value
    return summary


def heads_with_llc(request: Request, rows: list[dict], heads: list, agreement: dict | None) -> dict[str, object]:
    """``heads.png`` with each head's weight-refined λ̂ over the saved steps, coloured by its behaviour
    type, and the clusters of those curves against the types (:func:`reports.head_types.heads_figure`);
    nothing without per-head LLCs or a behaviour history."""
    from conf.objects import task_of
    from records.layout import HEADS_FIGURE, TENSORS_DIR
    from reports.head_types import head_label, heads_figure, read_head_history

    if not heads or not rows or "llc_mean" not in rows[0]:
        return {}
    history = read_head_history(request.run_dir / TENSORS_DIR, task_of(request.cfg).reader_behaviour)
    if history is None:
        return {}
    steps = np.array([r["step"] for r in rows], dtype=float)
    llc = {head_label(l, h): (steps, np.array([r[f"llc_{head_label(l, h)}"] for r in rows])) for l, h in heads}
    found = (agreement or {}).get("weight_refined", {})
    caption = (
        f"ARI {found['ari']:+.2f} (null mean {found['ari_null_mean']:+.2f}, 95 % {found['ari_null_95']:+.2f};"
        f" p {found['ari_p']:.3f})"
        if "ari" in found
        else ""
    )
    title = f"{request.run_dir.name}: every head's weight-refined LLC"
    return {HEADS_FIGURE: heads_figure(history, title, llc, found.get("clusters"), caption)}


def head_type_agreement(request: Request, rows: list[dict], heads: list, data_refined: list[str]) -> dict | None:
    """Every head's behaviour type at the run's last snapshot (its tensor store, :mod:`reports.head_types`)
    against the clusters of the heads' refined LLC curves (:mod:`metrics.dynamics.head_clusters`): for
    the weight-refined curves and each data-refined set, the clusters, their ARI with the types and its
    permutation null, and each type's mean final λ̂ (Wang et al. 2024's ordering). None without
    per-head LLCs or a behaviour history."""
    from conf.objects import task_of
    from metrics.dynamics.head_clusters import cluster_agreement
    from records.layout import TENSORS_DIR
    from reports.head_types import head_label, read_head_history

    if not heads or len(rows) < 3:
        return None
    history = read_head_history(request.run_dir / TENSORS_DIR, task_of(request.cfg).reader_behaviour)
    if history is None:
        return None
    labels = [head_label(layer, head) for layer, head in heads]
    types = [history.final_type(layer, head) for layer, head in heads]
    steps = np.array([r["step"] for r in rows], dtype=float)
    found: dict = {"types": dict(zip(labels, types, strict=True))}
    for prefix, name in [("llc_", "weight_refined"), *((f"llc_on_{c}_", f"on_{c}") for c in data_refined)]:
        values = np.array([[r[f"{prefix}{label}"] for r in rows] for label in labels])  # (heads, steps)
        finite = np.isfinite(values).all(axis=0)
        if finite.sum() < 3:
            found[name] = {"left_out": "fewer than 3 steps where every head's λ̂ is finite"}
            continue
        agreement = cluster_agreement(steps[finite], values[:, finite], np.array(types))
        final = values[:, finite][:, -1]
        found[name] = {
            "clusters": dict(zip(labels, agreement.labels.tolist(), strict=True)),
            "ari": agreement.ari,
            "ari_null_mean": agreement.null_mean,
            "ari_null_95": agreement.null_95,
            "ari_p": agreement.p,
            "final": dict(zip(labels, final.tolist(), strict=True)),
            "final_by_type": {t: float(np.mean(final[np.array(types) == t])) for t in sorted(set(types))},
        }
    return found


def chain_estimates(rows: list[dict]) -> torch.Tensor:
    """``[steps, chains]``: each step's λ̂ of every SGLD chain (NaN where an estimate diverged)."""
    chains = sorted((key for key in rows[0] if re.fullmatch(r"llc_chain_\d+", key)), key=lambda k: int(k[10:]))
    return torch.tensor([[row[key] for key in chains] for row in rows], dtype=torch.float64)


def group_columns(prefix: str, records: dict[str, dict[str, float]]) -> dict[str, float]:
    """llc.csv's columns of each group's record: ``PREFIX + GROUP`` (λ̂), ``..._std`` and ``..._diverged``."""
    return {
        f"{prefix}{group}" + ("" if key == "mean" else f"_{key}"): record[key]
        for group, record in records.items()
        for key in ("mean", "std", "diverged")
    }


def data_refined_problems(cfg: DictConfig) -> list[str]:
    """``stages.llc.data_refined`` names components of the run's mixture task, once each."""
    names = list(cfg.stages.llc.data_refined)
    if not names:
        return []
    if cfg.data.name != "mixture":
        return [
            f"stages.llc.data_refined={names}: names components of a mixture task; this run's task is {cfg.data.name}"
        ]
    known = list(cfg.data.components)
    unknown = [name for name in names if name not in known]
    problems = [f"stages.llc.data_refined: {unknown} not among the run's components {known}"] if unknown else []
    if len(set(names)) < len(names):
        problems.append(f"stages.llc.data_refined={names}: a component named twice")
    return problems


def component_sequences(cfg: DictConfig, name: str, count: int) -> torch.Tensor:
    """``[count, seq_len]`` held-out sequences of component ``name`` of the run's mixture task, in its
    vocabulary: the data-refined LLC's loss."""
    from conf.objects import HELD_OUT_IDS, n_random, task_of

    task = task_of(cfg)
    return task.component_sequences(name, np.arange(HELD_OUT_IDS, HELD_OUT_IDS + count), n_random(cfg))


def diverged_estimates(row: dict) -> list[str]:
    """Which of a row's estimates diverged: ``model``, ``L0H1``, ..."""
    names = ["model"] if row.get("llc_diverged") else []
    return names + [
        key[4:-9] for key, value in row.items() if key.endswith("_diverged") and key != "llc_diverged" and value
    ]


def seconds_per_estimate(rows: list[dict]) -> float | None:
    """The mean time of the whole model's LLC estimates that finished (None when none did)."""
    finished = [r["llc_seconds"] for r in rows if "llc_seconds" in r and not r["llc_diverged"]]
    return float(np.mean(finished)) if finished else None


def nearest(step: float, change: dict) -> dict | None:
    """The phase-change point (onset / midpoint / end) nearest ``step``, and how far."""
    known = {part: value for part, value in change.items() if value is not None}
    if not known:
        return None
    part = min(known, key=lambda p: abs(known[p] - step))
    return {"part": part, "step": known[part], "distance": step - known[part]}


def strategy_switches(run_summary: dict) -> list[dict]:
    """The run's strategy switches (its stage truth: ``strategies/switch/{i}`` in ``summary.json``,
    :mod:`reports.strategy_timeline`), each ``{label, step, low, high}``; [] for a run without them."""
    found, i = [], 1
    while f"strategies/switch/{i}" in run_summary:
        key = f"strategies/switch/{i}"
        found.append(
            {
                "label": run_summary[key],
                "step": run_summary[f"{key}/step"],
                "low": run_summary.get(f"{key}/low", math.nan),
                "high": run_summary.get(f"{key}/high", math.nan),
            }
        )
        i += 1
    return found


def nearest_switch(boundary: Boundary, switches: list[dict]) -> dict | None:
    """The strategy switch nearest ``boundary``: its label and step, the distance (boundary minus
    switch) and whether the switch lies inside the boundary's interval."""
    if not switches:
        return None
    switch = min(switches, key=lambda s: abs(s["step"] - boundary.step))
    inside = boundary.low <= switch["step"] <= boundary.high
    return {**switch, "distance": boundary.step - switch["step"], "inside": bool(inside)}


def draw(rows, heads, series, dynamics, boundaries, states, change, cfg, request) -> dict[str, object]:
    """``stages.png`` (every signal on one step axis) and ``essential_dynamics.png``, as figures."""
    from metrics.dynamics.phase_change import PhaseChange
    from reports.run_report import intervention_windows
    from reports.stages_figure import essential_dynamics_figure, stages_figure

    steps = np.array([r["step"] for r in rows], dtype=float)
    llc, llc_std = {}, None
    if "llc_mean" in rows[0]:
        llc["model"] = (steps, np.array([r["llc_mean"] for r in rows]))
        llc_std = (steps, np.array([r["llc_std"] for r in rows]))
        for layer, head in heads:
            llc[f"L{layer}H{head}"] = (steps, np.array([r[f"llc_L{layer}H{head}"] for r in rows]))
    smoothed = None
    if states is not None:  # the curve the LLC's boundaries are read from, at its finite steps
        smoothed = (np.expm1(states.x.numpy()), states.smoothed.numpy())
    phase = None
    if all(v is not None for v in change.values()):
        phase = PhaseChange(change["onset"], change["midpoint"], change["end"], math.nan, math.nan)
    title = f"{request.run_dir.name}: {cfg.model.n_layers}L × {cfg.model.n_heads}H, d_model {cfg.model.d_model}"
    return {
        STAGES_FIGURE: stages_figure(
            llc,
            llc_std,
            smoothed,
            series,
            list(cfg.tracker.measures),
            boundaries,
            phase,
            title,
            intervention_windows(request.run_dir),
        ),
        ESSENTIAL_DYNAMICS_FIGURE: essential_dynamics_figure(
            dynamics, boundaries, f"{title}: essential dynamics (per-token losses)"
        ),
    }


def print_stages(result: dict) -> None:
    change = result["phase_change"]
    if all(v is not None for v in change.values()):
        print(
            f"stages: phase change (repeated-token loss): onset {change['onset']:.0f}, midpoint {change['midpoint']:.0f}, end {change['end']:.0f}"
        )
    else:
        print("stages: no phase change in the run's summary")
    explained = ", ".join(f"PC{c + 1} {100 * v:.0f} %" for c, v in enumerate(result["explained_variance"]))
    print(
        f"stages: essential dynamics: {result['significant_components']} of {len(result['explained_variance'])}"
        f" components beat the null ({explained} of the variance)"
    )
    if result["stages"]["llc_enabled"] and result["llc_band"] is None:
        print(f"stages: LLC: fewer than {MIN_STEPS} steps with a finite λ̂: no LLC boundary can be read")
    elif result["llc_band"] is not None:
        print(
            f"stages: LLC: a slope counts where |slope| / SE > {result['llc_band']:.2f}"
            f" (pure noise crosses that band with chance {result['stages']['alpha']:g})"
        )
    if not result["boundaries"]:
        print("stages: no boundary survives its null: one stage")
    switches = result.get("strategy_switches", [])
    if switches:
        print(
            "stages: strategy switches (the stage truth): "
            + ", ".join(f"{s['label']} at {s['step']:.0f} [{s['low']:.0f}, {s['high']:.0f}]" for s in switches)
        )
    nearest_switches = result.get("nearest_switch", [None] * len(result["boundaries"]))
    for point, near, switch in zip(result["boundaries"], result["nearest_phase_change"], nearest_switches, strict=True):
        print(
            f"stages: boundary at step {Boundary(**point).describe()}; {point['statistic_name']} {point['statistic']:.2f}"
            + (f"; {near['distance']:+.0f} steps from the phase change's {near['part']}" if near else "")
            + (
                f"; {switch['distance']:+.0f} steps from the switch {switch['label']} at {switch['step']:.0f}"
                f" ({'inside' if switch['inside'] else 'outside'} the boundary's interval)"
                if switch
                else ""
            )
        )
    for point in result["weak_boundaries"]:
        print(
            f"stages: not kept: {Boundary(**point).describe()}: fewer than"
            f" {100 * result['stages']['min_support']:.0f} % of the resamples find it"
        )
    if result["diverged"]:
        where = ", ".join(f"{step} ({', '.join(names)})" for step, names in result["diverged"].items())
        print(
            f"stages: warning: an SGLD chain diverged at steps {where} (λ̂ NaN there): lower stages.llc.lr or"
            " raise stages.llc.localization; python -m analysis.calibrate_llc RUN_DIR tries several"
        )
    if result["unsettled_steps"]:
        print(
            f"stages: warning: the LLC's loss trace had not settled at steps {result['unsettled_steps']} (see llc.csv's llc_drift)"
        )
    if result["llc_seconds_per_estimate"] is not None:
        print(f"stages: {result['llc_seconds_per_estimate']:.2f} s per LLC estimate of the whole model")


if __name__ == "__main__":
    sys.exit(main(Stages, description=__doc__.split("\n\n")[0]))
