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

import argparse
import csv
import json
import math
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from analysis.rescore import Request, select_steps, sweep_jobs, wandb_loggers
from conf.build import held_out_sequences, sgld_settings
from conf.schema import Config
from conf.validate import stages_problems
from metrics.dynamics.llc import LLCUnavailable, require_devinterp
from records.layout import ANALYSIS_DIR, CSV_RELATIVE_PATH, SUMMARY_NAME
from records.trajectory import Trajectory, TrajectoryError, describe_steps

DEFAULT_NAME = "stages"
STAGES_NAME = "stages.json"


class StagesError(ValueError):
    """A request that cannot run: the message says what is wrong, in one line."""


def stages_config(trajectory: Trajectory, overrides: list[str]) -> DictConfig:
    """The run's config on the schema with ``stages.*`` overrides, checked."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), trajectory.config)
    except OmegaConfBaseException as error:
        raise StagesError(f"the run's config does not fit this version's schema ({error})") from None
    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals:
            raise StagesError(f"{override!r}: an override is KEY=VALUE (e.g. stages.llc.lr=3e-4)")
        if not key.startswith("stages."):
            raise StagesError(f"{override!r}: only stages.* options apply here (the weights are fixed)")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as error:
            raise StagesError(f"{override!r}: {str(error).strip().splitlines()[0]}") from None
    problems = stages_problems(cfg.stages)
    if problems:
        raise StagesError("; ".join(problems))
    return cfg


@dataclass(frozen=True)
class StagesRequest:
    run_dir: Path
    cfg: DictConfig
    overrides: tuple[str, ...]
    steps: list[int]
    name: str

    @property
    def out_dir(self) -> Path:
        return self.run_dir / ANALYSIS_DIR / self.name


def plan(run_dir: Path, overrides: list[str], spec="all", every=1, name=None, overwrite=False) -> StagesRequest:
    """Check everything before anything is written or sampled."""
    trajectory = Trajectory(run_dir)
    cfg = stages_config(trajectory, overrides)
    if cfg.stages.llc_enabled:
        require_devinterp()
    try:
        steps = select_steps(trajectory.steps, spec, every)
    except ValueError as error:
        raise StagesError(str(error)) from None
    if len(steps) < 3:
        raise StagesError(f"{len(steps)} steps selected ({describe_steps(steps)}): stages need at least 3")
    for step in steps:
        trajectory.check(step)
    name = name or DEFAULT_NAME
    if not re.fullmatch(r"[A-Za-z0-9._=+,-]+", name) or name in (".", ".."):
        raise StagesError(f"--name {name!r}: use letters, digits and . _ = + , -")
    request = StagesRequest(Path(run_dir), cfg, tuple(overrides), steps, name)
    if request.out_dir.exists() and not overwrite:
        raise StagesError(f"{request.out_dir} exists: choose another --name, or --overwrite to replace that analysis")
    return request


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


def run_stages(request: StagesRequest) -> dict:
    """Measure every selected step, find the stages, write and log everything; returns stages.json's content."""
    from metrics.dynamics.llc import estimate_llc, head_masks
    from metrics.dynamics.stages import essential_dynamics, stage_boundaries
    from reports.run_report import read_series

    trajectory = Trajectory(request.run_dir)
    cfg, stages, out = request.cfg, request.cfg.stages, request.out_dir
    if cfg.tracker.num_threads:
        torch.set_num_threads(int(cfg.tracker.num_threads))
    llc_cfg = stages.llc
    settings = sgld_settings(llc_cfg)
    llc_rows = held_out_sequences(cfg, llc_cfg.batches * llc_cfg.batch_size)
    probe = held_out_sequences(cfg, stages.sequences, offset=llc_cfg.batches * llc_cfg.batch_size)
    heads = circuit_heads(request.run_dir) if stages.llc_enabled and llc_cfg.heads else []
    parts = ["essential dynamics"]
    if stages.llc_enabled:
        parts.insert(
            0,
            f"LLC ({settings.chains} chains × {settings.draws} draws, ε {settings.lr:g}, γ {settings.localization:g}, nβ {settings.n_beta:.3g})",
        )
    if heads:
        parts.insert(1, "per-head LLC of " + ", ".join(f"L{layer}H{head}" for layer, head in heads))
    print(
        f"stages: {len(request.steps)} saved steps of {request.run_dir} ({describe_steps(request.steps)}); {', '.join(parts)}; into {out}",
        flush=True,
    )
    rows, losses, started = [], [], time.perf_counter()
    for i, step in enumerate(request.steps):
        model = trajectory.model(step)
        losses.append(per_token_losses(model, probe))
        row: dict[str, float] = {"step": step}
        if stages.llc_enabled:
            estimate = estimate_llc(model, llc_rows, settings)
            row.update(
                llc_mean=estimate.mean,
                llc_std=estimate.std,
                llc_drift=estimate.drift,
                llc_settled=float(estimate.settled(llc_cfg.settle_tolerance)),
                llc_init_loss=estimate.init_loss,
                llc_seconds=estimate.seconds,
            )
            for layer, head in heads:
                by_head = estimate_llc(model, llc_rows, settings, param_masks=head_masks(model, layer, head))
                row[f"llc_L{layer}H{head}"] = by_head.mean
                row[f"llc_L{layer}H{head}_std"] = by_head.std
        rows.append(row)
        elapsed = time.perf_counter() - started
        if "llc_mean" in row:
            settled = "" if row["llc_settled"] else f" NOT SETTLED (drift {row['llc_drift']:+.2f})"
            what = f"λ̂ {row['llc_mean']:.2f} ± {row['llc_std']:.2f} in {row['llc_seconds']:.1f} s{settled}"
        else:
            what = "losses"
        print(f"stages: step {step} ({i + 1}/{len(request.steps)}): {what}; {elapsed:.0f} s so far", flush=True)
    seconds = time.perf_counter() - started
    if out.exists():  # --overwrite: this analysis only, and only once the new one is measured
        shutil.rmtree(out)
    out.mkdir(parents=True)
    steps_t = torch.tensor(request.steps, dtype=torch.float64)
    dynamics = essential_dynamics(steps_t, torch.stack(losses), stages.components)
    llc_curve = (steps_t, torch.tensor([r["llc_mean"] for r in rows])) if stages.llc_enabled else None
    boundaries = stage_boundaries(llc_curve, dynamics, stages.window, stages.min_turn)
    summary_path = request.run_dir / SUMMARY_NAME
    run_summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    change = {part: run_summary.get(f"phase_change/loss_{part}_step") for part in ("onset", "midpoint", "end")}
    result = {
        "run_dir": str(request.run_dir),
        "steps": request.steps,
        "overrides": list(request.overrides),
        "stages": OmegaConf.to_container(stages, resolve=True),
        "n_beta": settings.n_beta,
        "circuit_heads": [f"L{layer}H{head}" for layer, head in heads],
        "boundaries": [asdict(p) for p in boundaries],
        "phase_change": change,
        "nearest_phase_change": [nearest(p.step, change) for p in boundaries],
        "explained_variance": dynamics.explained.tolist(),
        "seconds": seconds,
        "llc_seconds_per_estimate": float(np.mean([r["llc_seconds"] for r in rows])) if stages.llc_enabled else None,
        "unsettled_steps": [r["step"] for r in rows if stages.llc_enabled and not r["llc_settled"]],
    }
    write_csv(out / "llc.csv", rows)
    write_csv(
        out / "essential_dynamics.csv",
        [
            {"step": s, **{f"PC{c + 1}": float(v) for c, v in enumerate(coords)}}
            for s, coords in zip(request.steps, dynamics.coords, strict=True)
        ],
    )
    (out / STAGES_NAME).write_text(json.dumps(result, indent=1))
    csv_path = request.run_dir / CSV_RELATIVE_PATH
    series = read_series(csv_path) if csv_path.is_file() else {}
    figures = draw(out, rows, heads, series, dynamics, boundaries, change, cfg, request)
    log_to_wandb(request, trajectory, rows, dynamics, figures, result)
    print_stages(result)
    print(f"stages: {len(request.steps)} steps in {seconds:.1f} s; wrote {out}")
    return result


def nearest(step: float, change: dict) -> dict | None:
    """The phase-change point (onset / midpoint / end) nearest ``step``, and how far."""
    known = {part: value for part, value in change.items() if value is not None}
    if not known:
        return None
    part = min(known, key=lambda p: abs(known[p] - step))
    return {"part": part, "step": known[part], "distance": step - known[part]}


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def draw(out, rows, heads, series, dynamics, boundaries, change, cfg, request) -> dict[str, Path]:
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
    phase = None
    if all(v is not None for v in change.values()):
        phase = PhaseChange(change["onset"], change["midpoint"], change["end"], math.nan, math.nan)
    title = f"{request.run_dir.name}: {cfg.model.n_layers}L × {cfg.model.n_heads}H, d_model {cfg.model.d_model}"
    figures = {"stages": out / "stages.png", "essential_dynamics": out / "essential_dynamics.png"}
    for key, figure in (
        ("stages", stages_figure(llc, llc_std, series, list(cfg.tracker.measures), boundaries, phase, title)),
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
    loggers = wandb_loggers(
        Request(request.run_dir, request.cfg, request.overrides, request.steps, request.name), trajectory
    )
    if not loggers:
        return
    import wandb

    logger = loggers[0]
    for row, coords in zip(rows, dynamics.coords, strict=True):
        metrics = {f"stages/{k}": v for k, v in row.items() if k != "step"}
        metrics.update({f"stages/PC{c + 1}": float(v) for c, v in enumerate(coords)})
        logger.experiment.log({**metrics, "trainer/global_step": row["step"]})
    logger.experiment.log({f"images/{key}": wandb.Image(str(path)) for key, path in figures.items()})
    logger.experiment.summary.update(
        {
            "stages/boundaries": [p["step"] for p in result["boundaries"]],
            "stages/boundary_sources": [p["source"] for p in result["boundaries"]],
            "stages/seconds": result["seconds"],
        }
    )
    wandb.finish()


def print_stages(result: dict) -> None:
    change = result["phase_change"]
    if all(v is not None for v in change.values()):
        print(
            f"stages: phase change (repeated-token loss): onset {change['onset']:.0f}, midpoint {change['midpoint']:.0f}, end {change['end']:.0f}"
        )
    else:
        print("stages: no phase change in the run's summary")
    if not result["boundaries"]:
        print("stages: no turning point: one stage")
    for point, near in zip(result["boundaries"], result["nearest_phase_change"], strict=True):
        where = f"; {near['distance']:+.0f} steps from the phase change's {near['part']}" if near else ""
        print(f"stages: boundary at step {point['step']:.0f}: {point['source']} {point['kind']}{where}")
    if result["unsettled_steps"]:
        print(
            f"stages: warning: the LLC's loss trace had not settled at steps {result['unsettled_steps']} (see llc.csv's llc_drift)"
        )
    if result["llc_seconds_per_estimate"] is not None:
        print(f"stages: {result['llc_seconds_per_estimate']:.2f} s per LLC estimate of the whole model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a train.py run directory with trajectory/, or a sweep directory")
    parser.add_argument("overrides", nargs="*", help="stages.* options: stages.llc.lr=3e-4 stages.llc.heads=false ...")
    parser.add_argument("--steps", default="all", help="which saved steps: all (default), A:B, or 100,200,300")
    parser.add_argument("--every", type=int, default=1, help="every k-th of the selected steps")
    parser.add_argument("--name", default=None, help=f"the analysis's directory name (default: {DEFAULT_NAME})")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace analysis/NAME if it exists (that analysis only)"
    )
    args = parser.parse_intermixed_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir}: no such run or sweep directory", file=sys.stderr)
        return 2
    jobs = sweep_jobs(args.run_dir)
    try:  # every job is checked before any is written
        requests = [
            plan(job, args.overrides, args.steps, args.every, args.name, args.overwrite)
            for job in (jobs or [args.run_dir])
        ]
    except (TrajectoryError, StagesError, LLCUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for request in requests:
        run_stages(request)
    if jobs:
        from reports.sweep_report import print_sweep_report, sweep_report

        print_sweep_report(sweep_report(jobs, args.run_dir / ANALYSIS_DIR / requests[0].name, stages=requests[0].name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
