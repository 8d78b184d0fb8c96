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
  with its chain spread and whether its loss trace settled; with ``stages.llc.heads`` also λ̂ of
  each head of the circuit pair, sampled alone;
- the per-token losses on ``stages.sequences`` fixed held-out sequences: the essential dynamics
  (:mod:`metrics.dynamics.stages`) are their principal components over the trajectory.

Stage boundaries are the turning points of the LLC curve and of each component. Outputs, under
``RUN_DIR/analysis/NAME/`` (``stages`` unless ``--name``): ``llc.csv``, ``essential_dynamics.csv``,
``stages.json`` (boundaries, the phase change, settings, wall times), ``stages.png`` (every signal
on one step axis, stages shaded), ``essential_dynamics.png``, and a W&B run (``job_type=analysis``)
in the run's group with the curves and both figures. An existing analysis is kept unless
``--overwrite``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from analysis.saved_run import (
    AnalysisError,
    Request,
    argument_parser,
    checked_steps,
    new_request,
    run_config,
    run_each_job,
    wandb_loggers,
)
from conf.build import held_out_sequences, llc_sequences, sgld_settings, stage_settings
from conf.validate import llc_calibration_warning, stages_problems
from metrics.dynamics.llc import LLCUnavailable, require_devinterp
from metrics.dynamics.stages import MIN_STEPS, Boundary
from records.csv_log import write_rows
from records.layout import (
    CSV_RELATIVE_PATH,
    ESSENTIAL_DYNAMICS_FIGURE,
    ESSENTIAL_DYNAMICS_TABLE,
    LLC_TABLE,
    MEASURED_SETTINGS,
    STAGES_FIGURE,
    STAGES_RECORD,
    STEP_FILES,
    SUMMARY_NAME,
    measurements_dir,
    step_file,
)
from records.trajectory import Trajectory, describe_steps

DEFAULT_NAME = "stages"
BOUNDARY_KEYS = ("step", "source", "kind", "low", "high", "support", "statistic")
"""What W&B's summary keeps of each boundary, one list a key (``stages/boundary_step``, ...)."""


def stages_config(trajectory: Trajectory, overrides: list[str]) -> DictConfig:
    """The run's config on the schema with ``stages.*`` overrides, checked."""
    cfg = run_config(trajectory, overrides, "stages", "stages.llc.lr=3e-4")
    problems = stages_problems(cfg.stages)
    if problems:
        raise AnalysisError("; ".join(problems))
    return cfg


def plan(run_dir: Path, overrides: list[str], spec: str = "all", every: int = 1, name: str | None = None) -> Request:
    """Check everything before anything is written or sampled."""
    trajectory = Trajectory(run_dir)
    cfg = stages_config(trajectory, overrides)
    if cfg.stages.llc_enabled:
        require_devinterp()
    steps = checked_steps(trajectory, spec, every, at_least=3)
    return new_request(run_dir, cfg, overrides, steps, name or DEFAULT_NAME)


def circuit_heads(run_dir: Path) -> list[tuple[int, int]]:
    """The circuit pair's (layer, head) twice, from the run's last snapshot ([] without one)."""
    from reports.sweep_report import final_circuit_pair

    pair = final_circuit_pair(run_dir)
    return [(int(layer), int(head)) for layer, head in re.findall(r"L(\d+)H(\d+)", pair)]


def per_token_losses(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[sequences * (seq_len - 1)]``: the model's next-token loss at every position of ``tokens``."""
    from metrics.dynamics.llc import next_token_loss

    with torch.no_grad():
        return next_token_loss(model, tokens).flatten()


def run_stages(request: Request) -> dict:
    """Measure every selected step, find the stages, write and log everything; returns stages.json's content."""
    cfg, stages = request.cfg, request.cfg.stages
    if cfg.tracker.num_threads:
        torch.set_num_threads(int(cfg.tracker.num_threads))
    settings = sgld_settings(stages.llc)
    if stages.llc_enabled and (warning := llc_calibration_warning(cfg)):
        print(warning, file=sys.stderr)
    heads = circuit_heads(request.run_dir) if stages.llc_enabled and stages.llc.heads else []
    parts = ["essential dynamics"]
    if stages.llc_enabled:
        parts.insert(
            0,
            f"LLC ({settings.chains} chains × {settings.draws} draws, ε {settings.lr:g}, γ {settings.localization:g}, nβ {settings.n_beta:.3g})",
        )
    if heads:
        parts.insert(1, "per-head LLC of " + ", ".join(f"L{layer}H{head}" for layer, head in heads))
    print(
        f"stages: {len(request.steps)} saved steps of {request.run_dir} ({describe_steps(request.steps)});"
        f" {', '.join(parts)}; into {request.out_dir}",
        flush=True,
    )
    measured = MeasuredSteps(measurements_dir(request.out_dir), measurement_settings(stages, heads))
    try:
        rows, losses, seconds = measure_steps(request, heads, measured)
    except KeyboardInterrupt:
        print(
            f"\nstages: stopped; {len(measured.steps)} measured steps kept in {measured.directory}: the same command"
            " continues from there",
            flush=True,
        )
        raise SystemExit(130) from None
    try:
        result = write_analysis(request, rows, losses, heads, seconds)
    except BaseException as error:  # half-written: the measurements stay, the same command writes it again
        shutil.rmtree(request.out_dir, ignore_errors=True)
        if isinstance(error, KeyboardInterrupt):
            print(f"\nstages: stopped while writing; the same command writes it from {measured.directory}", flush=True)
            raise SystemExit(130) from None
        raise
    print_stages(result)
    print(
        f"stages: {len(request.steps)} steps, {seconds:.1f} s of measuring; wrote {request.out_dir} (the measurements"
        f" stay in {measured.directory}: --overwrite with other reading settings, stages.alpha=... and the like,"
        " reads them again without measuring)"
    )
    return result


def measure_steps(request: Request, heads: list[tuple[int, int]], measured: MeasuredSteps):
    """Every selected step's llc.csv row and per-token losses, from ``measured`` where an interrupted
    run left them, else measured now and saved there; a progress line a step. Returns ``(rows,
    losses, seconds spent measuring now)``."""
    trajectory, cfg, stages = Trajectory(request.run_dir), request.cfg, request.cfg.stages
    llc_rows = llc_sequences(cfg)
    probe = held_out_sequences(cfg, stages.sequences, offset=stages.llc.batches * stages.llc.batch_size)
    if done := len(set(measured.steps) & set(request.steps)):
        print(
            f"stages: continuing: {done} of the {len(request.steps)} steps are measured already, with these settings"
            f" ({measured.directory})",
            flush=True,
        )
    rows, losses, spent, fresh = [], [], 0.0, 0
    for i, step in enumerate(request.steps):
        kept = measured.get(step)
        if kept is None:
            started = time.perf_counter()
            row, step_losses = measure_step(trajectory.model(step), stages, llc_rows, probe, heads)
            measured.put(step, {"step": step, **row}, step_losses)
            spent, fresh = spent + time.perf_counter() - started, fresh + 1
        row, step_losses = kept or measured.get(step)
        rows.append(row)
        losses.append(step_losses)
        to_measure = sum(1 for later in request.steps[i + 1 :] if later not in measured.steps)
        left = f", about {spent / fresh * to_measure:.0f} s left" if fresh else ""
        print(
            f"stages: step {step} ({i + 1}/{len(request.steps)}): {describe_row(row)}{' (kept)' if kept else ''};"
            f" {spent:.0f} s of measuring{left}",
            flush=True,
        )
    return rows, losses, spent


def write_analysis(request: Request, rows: list[dict], losses: list[torch.Tensor], heads, seconds: float) -> dict:
    """The stages from the measured rows and losses: the CSVs, the figures, the W&B run and, last
    (so that its presence means the analysis is whole), stages.json; returns its content."""
    from metrics.dynamics.stages import stage_boundaries
    from reports.run_report import read_series

    cfg, stages, out = request.cfg, request.cfg.stages, request.out_dir
    if out.exists():  # --overwrite: this analysis only, and only once the new one is measured
        shutil.rmtree(out)
    out.mkdir(parents=True)
    steps_t = torch.tensor(request.steps, dtype=torch.float64)
    llc = (steps_t, chain_estimates(rows)) if stages.llc_enabled else None
    boundaries, dynamics, states = stage_boundaries(
        llc, (steps_t, torch.stack(losses)), stage_settings(stages), stages.components
    )
    summary_path = request.run_dir / SUMMARY_NAME
    run_summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    change = {part: run_summary.get(f"phase_change/loss_{part}_step") for part in ("onset", "midpoint", "end")}
    result = {
        "run_dir": str(request.run_dir),
        "steps": request.steps,
        "overrides": list(request.overrides),
        "stages": OmegaConf.to_container(stages, resolve=True),
        "n_beta": sgld_settings(stages.llc).n_beta,
        "circuit_heads": [f"L{layer}H{head}" for layer, head in heads],
        "boundaries": [asdict(b) for b in boundaries if b.kept],
        "weak_boundaries": [asdict(b) for b in boundaries if not b.kept],  # found, but in too few resamples
        "phase_change": change,
        "nearest_phase_change": [nearest(b.step, change) for b in boundaries if b.kept],
        "explained_variance": dynamics.explained.tolist(),
        "significant_components": dynamics.significant,
        "llc_band": states.q if states is not None else None,
        "seconds": seconds,
        "llc_seconds_per_estimate": seconds_per_estimate(rows),
        "unsettled_steps": [
            r["step"] for r in rows if stages.llc_enabled and not r["llc_settled"] and not r["llc_diverged"]
        ],
        "diverged": {str(r["step"]): diverged_estimates(r) for r in rows if diverged_estimates(r)},  # step: which
    }
    write_rows(out / LLC_TABLE, rows)
    write_rows(
        out / ESSENTIAL_DYNAMICS_TABLE,
        [
            {"step": s, **{f"PC{c + 1}": float(v) for c, v in enumerate(coords)}}
            for s, coords in zip(request.steps, dynamics.coords, strict=True)
        ],
    )
    csv_path = request.run_dir / CSV_RELATIVE_PATH
    series = read_series(csv_path) if csv_path.is_file() else {}
    figures = draw(out, rows, heads, series, dynamics, [b for b in boundaries if b.kept], states, change, cfg, request)
    log_to_wandb(request, Trajectory(request.run_dir), rows, dynamics, figures, result)
    written = out / f"{STAGES_RECORD}.tmp"
    written.write_text(json.dumps(result, indent=1))
    written.replace(out / STAGES_RECORD)
    return result


def chain_estimates(rows: list[dict]) -> torch.Tensor:
    """``[steps, chains]``: each step's λ̂ of every SGLD chain (NaN where an estimate diverged)."""
    chains = sorted((key for key in rows[0] if re.fullmatch(r"llc_chain_\d+", key)), key=lambda k: int(k[10:]))
    return torch.tensor([[row[key] for key in chains] for row in rows], dtype=torch.float64)


def measure_step(model, stages: DictConfig, llc_rows, probe, heads) -> tuple[dict, torch.Tensor]:
    """One saved step's row of llc.csv (λ̂ of the model and of each head in ``heads``, each head's
    ``..._diverged`` too) and its per-token losses on ``probe``."""
    from metrics.dynamics.llc import head_masks, llc_record

    row: dict[str, float] = {}
    if stages.llc_enabled:
        settings, tolerance = sgld_settings(stages.llc), stages.llc.settle_tolerance
        row.update({f"llc_{key}": value for key, value in llc_record(model, llc_rows, settings, tolerance).items()})
        for layer, head in heads:
            by_head = llc_record(model, llc_rows, settings, tolerance, head_masks(model, layer, head))
            for key in ("mean", "std", "diverged"):
                row[f"llc_L{layer}H{head}" + ("" if key == "mean" else f"_{key}")] = by_head[key]
    return row, per_token_losses(model, probe)


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


def describe_row(row: dict) -> str:
    """What one step's progress line says of it."""
    if "llc_mean" not in row:
        return "losses"
    heads = [name for name in diverged_estimates(row) if name != "model"]
    also = f"; λ̂ of {', '.join(heads)} DIVERGED" if heads else ""
    if row["llc_diverged"]:
        return f"λ̂ DIVERGED (a non-finite loss) after {row['llc_seconds']:.1f} s{also}"
    settled = "" if row["llc_settled"] else f" NOT SETTLED (drift {row['llc_drift']:+.2f})"
    return f"λ̂ {row['llc_mean']:.2f} ± {row['llc_std']:.2f} in {row['llc_seconds']:.1f} s{settled}{also}"


def measurement_settings(stages: DictConfig, heads: list[tuple[int, int]]) -> dict:
    """What a step's measurements depend on (not how the curves are read afterwards)."""
    llc = {k: v for k, v in OmegaConf.to_container(stages.llc, resolve=True).items() if k != "every_n_steps"}
    return {
        "llc_enabled": stages.llc_enabled,
        "llc": llc,
        "sequences": stages.sequences,
        "heads": [list(h) for h in heads],
        "row": "per-chain",  # rows carry each chain's λ̂ (llc_chain_*): older measurements do not
    }


class MeasuredSteps:
    """Each step's measurements, saved as soon as they are made under ``RUN_DIR/analysis/.NAME.measured/``
    (one safetensors file a step: the per-token losses, the row in its header), so that an
    interrupted analysis (Ctrl-C, a time limit, a crash) continues where it stopped when run again
    with the same settings, and a finished one is read again (``--overwrite`` with other
    reading settings, other ``--steps``) without measuring what is there; other measurement settings
    discard them."""

    def __init__(self, directory: Path, settings: dict) -> None:
        self.directory = directory
        wanted = json.dumps(settings, sort_keys=True)
        saved = directory / MEASURED_SETTINGS
        if directory.exists() and (not saved.is_file() or saved.read_text() != wanted):
            print(f"stages: {directory} holds steps measured with other settings: measuring afresh", flush=True)
            shutil.rmtree(directory)
        directory.mkdir(parents=True, exist_ok=True)
        saved.write_text(wanted)
        self.steps = sorted(int(p.stem.removeprefix("step-")) for p in directory.glob(STEP_FILES))

    def path(self, step: int) -> Path:
        return self.directory / step_file(step)

    def get(self, step: int) -> tuple[dict, torch.Tensor] | None:
        from safetensors import safe_open

        if step not in self.steps:
            return None
        with safe_open(self.path(step), framework="pt") as handle:
            return json.loads(handle.metadata()["row"]), handle.get_tensor("losses")

    def put(self, step: int, row: dict, losses: torch.Tensor) -> None:
        from safetensors.torch import save_file

        written = self.path(step).with_suffix(".tmp")
        save_file({"losses": losses.contiguous()}, written, metadata={"row": json.dumps(row)})
        written.replace(self.path(step))  # whole or not at all: a kill mid-write leaves no half step
        self.steps.append(step)


def nearest(step: float, change: dict) -> dict | None:
    """The phase-change point (onset / midpoint / end) nearest ``step``, and how far."""
    known = {part: value for part, value in change.items() if value is not None}
    if not known:
        return None
    part = min(known, key=lambda p: abs(known[p] - step))
    return {"part": part, "step": known[part], "distance": step - known[part]}


def draw(out, rows, heads, series, dynamics, boundaries, states, change, cfg, request) -> dict[str, Path]:
    from metrics.dynamics.phase_change import PhaseChange
    from reports.plots import plt
    from reports.stages_figure import essential_dynamics_figure, stages_figure

    steps = np.array([r["step"] for r in rows], dtype=float)
    llc, llc_std = {}, None
    if "llc_mean" in rows[0]:
        llc["model"] = (steps, np.array([r["llc_mean"] for r in rows]))
        llc_std = (steps, np.array([r["llc_std"] for r in rows]))
        for layer, head in heads:
            llc[f"L{layer}H{head} alone"] = (steps, np.array([r[f"llc_L{layer}H{head}"] for r in rows]))
    smoothed = None
    if states is not None:  # the curve the LLC's boundaries are read from, at its finite steps
        smoothed = (np.expm1(states.x.numpy()), states.smoothed.numpy())
    phase = None
    if all(v is not None for v in change.values()):
        phase = PhaseChange(change["onset"], change["midpoint"], change["end"], math.nan, math.nan)
    title = f"{request.run_dir.name}: {cfg.model.n_layers}L × {cfg.model.n_heads}H, d_model {cfg.model.d_model}"
    figures = {"stages": out / STAGES_FIGURE, "essential_dynamics": out / ESSENTIAL_DYNAMICS_FIGURE}
    for key, figure in (
        ("stages", stages_figure(llc, llc_std, smoothed, series, list(cfg.tracker.measures), boundaries, phase, title)),
        (
            "essential_dynamics",
            essential_dynamics_figure(dynamics, boundaries, f"{title}: essential dynamics (per-token losses)"),
        ),
    ):
        figure.savefig(figures[key], dpi=110)
        plt.close(figure)
    return figures


def log_to_wandb(request, trajectory, rows, dynamics, figures, result) -> None:
    """The curves at their steps, both figures, and the boundaries in the summary, in a W&B run
    grouped with the training run (none when the run had W&B off)."""
    loggers = wandb_loggers(request, trajectory)
    if not loggers:
        return
    logger = loggers[0]
    for row, coords in zip(rows, dynamics.coords, strict=True):
        metrics = {f"stages/{k}": v for k, v in row.items() if k != "step"}
        metrics.update({f"stages/PC{c + 1}": float(v) for c, v in enumerate(coords)})
        logger.log_metrics(metrics, step=row["step"])
    for key, path in figures.items():
        logger.log_image(key=f"images/{key}", images=[str(path)], step=rows[-1]["step"])
    logger.log_summary(
        {
            **{f"stages/boundary_{key}": [b[key] for b in result["boundaries"]] for key in BOUNDARY_KEYS},
            "stages/significant_components": result["significant_components"],
            "stages/seconds": result["seconds"],
        }
    )
    logger.finish()


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
    for point, near in zip(result["boundaries"], result["nearest_phase_change"], strict=True):
        print(
            f"stages: boundary at step {Boundary(**point).describe()}; {point['statistic_name']} {point['statistic']:.2f}"
            + (f"; {near['distance']:+.0f} steps from the phase change's {near['part']}" if near else "")
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


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(
        __doc__.split("\n\n")[0], "stages.* options: stages.llc.lr=3e-4 stages.llc.heads=false ...", DEFAULT_NAME
    )
    return run_each_job(
        parser.parse_intermixed_args(argv),
        plan,
        run_stages,
        report_as="stages",
        errors=(LLCUnavailable,),
        incomplete=lambda result: bool(result["diverged"]),
        finished=finished,
    )


def finished(request: Request) -> dict | None:
    """``request``'s stages.json if its analysis was written whole before (stages.json comes last)
    with the same overrides and steps, else None."""
    try:
        written = json.loads((request.out_dir / STAGES_RECORD).read_text())
    except (OSError, ValueError):
        return None
    same = written.get("overrides") == list(request.overrides) and written.get("steps") == request.steps
    return written if same else None


if __name__ == "__main__":
    sys.exit(main())
