"""Calibrate the LLC's SGLD settings on a run: a sweep of step size ε × localization γ at a few saved
steps, every chain's loss trace drawn, and a pick.

    python -m analysis.calibrate_llc RUN_DIR
    python -m analysis.calibrate_llc RUN_DIR --lr 1e-4,3e-4,1e-3,3e-3 --localization 10,100,300 --steps 0,400,1500

A setting passes when at every chosen step its chains are finite, their loss traces have settled
(|drift| <= ``stages.llc.settle_tolerance``: the last third of the draws within that share of λ̂ of
the first third) and they agree (std across chains <= ``--max-spread`` of λ̂). The pick is the
passing setting with the weakest localization (the least restricted posterior), then the smallest
step (the least discretisation bias). Other ``stages.llc.*`` settings (chains, draws, nβ, ...)
come from the config and the overrides. Writes ``RUN_DIR/analysis/llc_calibration/``:
``calibration.csv`` and ``traces.png`` (rows ε, columns γ; each chosen step a colour, each chain
a line). The devinterp guidance it follows: Lau et al. 2023 and devinterp's calibration notebooks
(the trace should rise and flatten, not climb or blow up).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from analysis.saved_run import AnalysisError
from analysis.stages import stages_config
from conf.build import llc_sequences, n_beta_of
from metrics.dynamics.llc import LLCUnavailable, require_devinterp
from records.csv_log import write_rows
from records.layout import ANALYSIS_DIR, CALIBRATION_FIGURE, CALIBRATION_TABLE, SUMMARY_NAME
from records.trajectory import Trajectory, TrajectoryError

NAME = "llc_calibration"


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AnalysisError(f"{flag} {text!r}: give comma-separated numbers, e.g. 1e-4,1e-3") from None
    if not values or any(not v > 0 for v in values):
        raise AnalysisError(f"{flag} {text!r}: every value must be > 0")
    return values


def default_steps(trajectory: Trajectory) -> list[int]:
    """The first saved step, the one nearest the phase change's midpoint (else the middle one), the last."""
    import json

    steps = trajectory.steps
    summary = trajectory.run_dir / SUMMARY_NAME
    midpoint = json.loads(summary.read_text()).get("phase_change/loss_midpoint_step") if summary.is_file() else None
    middle = min(steps, key=lambda s: abs(s - midpoint)) if midpoint is not None else steps[len(steps) // 2]
    return sorted({steps[0], middle, steps[-1]})


def pick(rows: list[dict]) -> dict | None:
    """The passing (ε, γ) with the smallest γ, then the smallest ε (None when none passes)."""
    settings = sorted({(r["localization"], r["lr"]) for r in rows})
    for localization, lr in settings:
        at = [r for r in rows if r["localization"] == localization and r["lr"] == lr]
        if all(r["passes"] for r in at):
            return {"lr": lr, "localization": localization}
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("overrides", nargs="*", help="stages.llc.* options held fixed: stages.llc.draws=200 ...")
    parser.add_argument("--lr", default="1e-4,3e-4,1e-3,3e-3", help="step sizes ε to try")
    parser.add_argument("--localization", default="10,100,300", help="localizations γ to try")
    parser.add_argument("--steps", default=None, help="saved steps (default: first, nearest the phase change, last)")
    parser.add_argument("--max-spread", type=float, default=0.1, help="largest std across chains, a share of λ̂")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing calibration")
    args = parser.parse_intermixed_args(argv)
    try:
        trajectory = Trajectory(args.run_dir)
        cfg = stages_config(trajectory, args.overrides)
        require_devinterp()
        lrs, gammas = parse_floats(args.lr, "--lr"), parse_floats(args.localization, "--localization")
        steps = [int(s) for s in args.steps.split(",")] if args.steps else default_steps(trajectory)
        for step in steps:
            trajectory.check(step)
        out = args.run_dir / ANALYSIS_DIR / NAME
        if out.exists() and not args.overwrite:
            raise AnalysisError(f"{out} exists: pass --overwrite to replace it")
    except (TrajectoryError, AnalysisError, LLCUnavailable, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from metrics.dynamics.llc import SGLDSettings, estimate_llc
    from reports.plots import plt

    llc = cfg.stages.llc
    out.mkdir(parents=True, exist_ok=True)
    rows_data = llc_sequences(cfg)
    n_beta = n_beta_of(llc)
    print(
        f"calibrate_llc: ε {lrs} × γ {gammas} at steps {steps}; {llc.chains} chains × {llc.draws} draws"
        f" (burn-in {llc.burnin}), nβ {n_beta:.3g}, batch {llc.batch_size}; into {out}",
        flush=True,
    )
    fig, axes = plt.subplots(len(lrs), len(gammas), figsize=(3.4 * len(gammas), 2.6 * len(lrs)), squeeze=False)
    rows = []
    for i, lr in enumerate(lrs):
        for j, gamma in enumerate(gammas):
            settings = SGLDSettings(lr, n_beta, gamma, llc.chains, llc.draws, llc.burnin, llc.batch_size, llc.seed)
            ax = axes[i, j]
            for k, step in enumerate(steps):
                try:
                    estimate = estimate_llc(trajectory.model(step), rows_data, settings)
                except FloatingPointError:
                    estimate = None
                row = {"lr": lr, "localization": gamma, "step": step}
                if estimate is None:
                    row.update(llc_mean=math.nan, llc_std=math.nan, drift=math.nan, spread=math.nan, passes=False)
                else:
                    row.update(
                        llc_mean=estimate.mean,
                        llc_std=estimate.std,
                        drift=estimate.drift,
                        spread=estimate.spread,
                        passes=estimate.mean > 0
                        and estimate.settled(llc.settle_tolerance)
                        and estimate.spread <= args.max_spread,
                    )
                    for c, chain in enumerate(estimate.trace):
                        ax.plot(chain.numpy(), color=f"C{k}", lw=0.6, alpha=0.7, label=None if c else f"step {step}")
                rows.append(row)
                print(
                    f"  ε {lr:<7g} γ {gamma:<5g} step {step:>6}: λ̂ {row['llc_mean']:8.2f} ± {row['llc_std']:6.2f}"
                    f"  drift {row['drift']:+6.2f}  {'ok' if row['passes'] else 'FAILS'}",
                    flush=True,
                )
            verdict = "passes" if all(r["passes"] for r in rows[-len(steps) :]) else "fails"
            ax.set_title(
                f"ε {lr:g}, γ {gamma:g}: {verdict}", fontsize=9, color="k" if verdict == "passes" else "tab:red"
            )
            ax.grid(alpha=0.3)
            if i == len(lrs) - 1:
                ax.set_xlabel("draw")
            if j == 0:
                ax.set_ylabel("nβ (L_B(w) − L_B(w*))")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{args.run_dir.name}: SGLD loss traces (each line a chain)")
    fig.tight_layout()
    fig.savefig(out / CALIBRATION_FIGURE, dpi=100)
    plt.close(fig)
    write_rows(out / CALIBRATION_TABLE, rows)
    chosen, m = pick(rows), cfg.model
    if chosen is None:
        print(
            "calibrate_llc: no setting passes at every step: raise stages.llc.draws, or try other --lr / --localization"
        )
        return 1
    print(
        f"calibrate_llc: pick ε {chosen['lr']:g}, γ {chosen['localization']:g}"
        f" (stages.llc.lr={chosen['lr']:g} stages.llc.localization={chosen['localization']:g}"
        f" stages.llc.calibrated_on=[{m.n_layers},{m.n_heads},{m.d_model},{m.d_head}]); wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
