"""Calibrate the LLC's SGLD settings on a run: a sweep of step size ε × localization γ at a few saved
steps, every chain's loss trace drawn, and a pick.

    python -m analysis.calibrate_llc RUN_DIR
    python -m analysis.calibrate_llc RUN_DIR --lr 1e-4,3e-4,1e-3,3e-3 --localization 10,100,300 --steps 0,400,1500
    python -m analysis.calibrate_llc multirun/DATE/TIME        # every job, then each job's pick in the sweep report

A setting passes when at every chosen step its chains are finite, their loss traces have settled
(|drift| <= ``stages.llc.settle_tolerance``: the last third of the draws within that share of λ̂ of
the first third) and they agree (std across chains <= ``--max-spread`` of λ̂). The pick is the
passing setting with the weakest localization (the least restricted posterior), then the smallest
step (the least discretisation bias). Other ``stages.llc.*`` settings (chains, draws, nβ, ...)
come from the config and the overrides. Steps default to the first, the one nearest the phase
change's midpoint, and the last. Writes ``RUN_DIR/analysis/llc_calibration/`` through
:mod:`analysis.protocol`: ``calibration.csv`` (every setting at every step, and its verdict),
``traces.png`` (rows ε, columns γ; each chosen step a colour, each chain a line), ``steps.csv``, a
W&B run and ``analysis.json``; exit 1 when no setting passes, naming the steps where none does and
the pick without them (at initialisation λ̂ < 0 on some models: no setting settles there). The
devinterp guidance it follows: Lau et al. 2023 and devinterp's calibration notebooks (the trace
should rise and flatten, not climb or blow up).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from omegaconf import DictConfig

from analysis.protocol import Analysis, Conclusion, main
from analysis.saved_run import AnalysisError, Request
from conf.objects import llc_sequences, n_beta_of
from conf.validate import stages_problems
from metrics.dynamics.llc import LLCUnavailable, SGLDSettings, require_devinterp
from records.layout import CALIBRATION_FIGURE, CALIBRATION_TABLE, SUMMARY_NAME
from records.trajectory import Trajectory

MEASURED = ("llc_mean", "llc_std", "drift", "spread")
"""What each setting's estimate gives at a step (its row's columns ``SETTING/KEY``)."""


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AnalysisError(f"{flag} {text!r}: give comma-separated numbers, e.g. 1e-4,1e-3") from None
    if not values or any(not v > 0 for v in values):
        raise AnalysisError(f"{flag} {text!r}: every value must be > 0")
    return values


def setting_key(lr: float, localization: float) -> str:
    return f"lr={lr:g},localization={localization:g}"


def pick(rows: list[dict]) -> dict | None:
    """The passing (ε, γ) with the smallest γ, then the smallest ε (None when none passes)."""
    settings = sorted({(r["localization"], r["lr"]) for r in rows})
    for localization, lr in settings:
        at = [r for r in rows if r["localization"] == localization and r["lr"] == lr]
        if all(r["passes"] for r in at):
            return {"lr": lr, "localization": localization}
    return None


def steps_none_pass(rows: list[dict]) -> list[int]:
    """The steps at which no setting passes (e.g. the initialisation, where λ̂ < 0: no minimum yet)."""
    steps = sorted({r["step"] for r in rows})
    return [step for step in steps if not any(r["passes"] for r in rows if r["step"] == step)]


class CalibrateLLC(Analysis):
    """λ̂ of every (ε, γ) setting at each step, with its chains' traces; the pick."""

    kind = "llc_calibration"
    section = "stages"
    example = "stages.llc.draws=200"
    columns_title = "the LLC's calibration (python -m analysis.calibrate_llc): the pick, NaN where none passes"
    request_errors = (LLCUnavailable,)

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--lr", default="1e-4,3e-4,1e-3,3e-3", help="step sizes ε to try")
        parser.add_argument("--localization", default="10,100,300", help="localizations γ to try")
        parser.add_argument("--max-spread", type=float, default=0.1, help="largest std across chains, a share of λ̂")

    @classmethod
    def check(cls, cfg: DictConfig, options: dict) -> list[str]:
        parse_floats(options["lr"], "--lr")
        parse_floats(options["localization"], "--localization")
        if not options["max_spread"] > 0:
            raise AnalysisError(f"--max-spread {options['max_spread']}: must be > 0")
        problems = stages_problems(cfg.stages)
        if not problems:
            require_devinterp()
        return problems

    @classmethod
    def default_steps(cls, trajectory: Trajectory) -> str:
        """The first saved step, the one nearest the phase change's midpoint (else the middle one), the last."""
        steps = trajectory.steps
        summary = trajectory.run_dir / SUMMARY_NAME
        midpoint = json.loads(summary.read_text()).get("phase_change/loss_midpoint_step") if summary.is_file() else None
        middle = min(steps, key=lambda s: abs(s - midpoint)) if midpoint is not None else steps[len(steps) // 2]
        return ",".join(map(str, sorted({steps[0], middle, steps[-1]})))

    def __init__(self, request: Request) -> None:
        super().__init__(request)
        self.lrs = parse_floats(request.options["lr"], "--lr")
        self.gammas = parse_floats(request.options["localization"], "--localization")
        llc = request.cfg.stages.llc
        self.settings_of = {
            setting_key(lr, gamma): SGLDSettings(
                lr, n_beta_of(llc), gamma, llc.chains, llc.draws, llc.burnin, llc.batch_size, llc.seed
            )
            for lr in self.lrs
            for gamma in self.gammas
        }

    def describe(self) -> str:
        llc = self.cfg.stages.llc
        return (
            f"ε {self.lrs} × γ {self.gammas}; {llc.chains} chains × {llc.draws} draws (burn-in {llc.burnin}),"
            f" nβ {n_beta_of(llc):.3g}, batch {llc.batch_size}"
        )

    def start(self, loggers: list) -> None:
        self.rows_data = llc_sequences(self.cfg).to(self.request.torch_device)

    def measure(self, step: int, model) -> tuple[dict, dict[str, torch.Tensor]]:
        """Every setting's λ̂, spread and drift (NaN where a chain diverged) and its traces ``[chains, draws]``."""
        from metrics.dynamics.llc import estimate_llc

        row, traces = {}, {}
        for key, settings in self.settings_of.items():
            try:
                estimate = estimate_llc(model, self.rows_data, settings)
            except FloatingPointError:
                estimate = None
            values = (estimate.mean, estimate.std, estimate.drift, estimate.spread) if estimate else (math.nan,) * 4
            row.update({f"{key}/{name}": float(v) for name, v in zip(MEASURED, values, strict=True)})
            if estimate is not None:
                traces[key] = estimate.trace.float()
            print(
                f"  ε {settings.lr:<7g} γ {settings.localization:<5g} step {step:>6}: λ̂ {values[0]:8.2f} ± {values[1]:6.2f}"
                f"  drift {values[2]:+6.2f}  {'ok' if self.passes(row, key) else 'FAILS'}",
                flush=True,
            )
        return row, traces

    def passes(self, row: dict, key: str) -> bool:
        mean, drift, spread = (row[f"{key}/{name}"] for name in ("llc_mean", "drift", "spread"))
        tolerance = self.cfg.stages.llc.settle_tolerance
        return (
            mean > 0
            and math.isfinite(drift)
            and abs(drift) <= tolerance
            and spread <= self.request.options["max_spread"]
        )

    def describe_row(self, row: dict) -> str:
        passing = sum(self.passes(row, key) for key in self.settings_of)
        return f"{passing} of {len(self.settings_of)} settings pass"

    def conclude(self, rows: list[dict], tensors: list[dict]) -> Conclusion:
        table = [
            {
                "lr": settings.lr,
                "localization": settings.localization,
                "step": row["step"],
                **{name: row[f"{key}/{name}"] for name in MEASURED},
                "passes": self.passes(row, key),
            }
            for key, settings in self.settings_of.items()
            for row in rows
        ]
        chosen = pick(table)
        columns = {
            "llc_pick_lr": chosen["lr"] if chosen else math.nan,
            "llc_pick_localization": chosen["localization"] if chosen else math.nan,
        }
        return Conclusion(
            result={"pick": chosen, "max_spread": self.request.options["max_spread"]},
            tables={CALIBRATION_TABLE: table},
            figures={CALIBRATION_FIGURE: self.draw(rows, tensors, table)},
            summary={f"{self.kind}/{k}": v for k, v in columns.items()},
            columns=columns,
            incomplete=chosen is None,
        )

    def draw(self, rows: list[dict], tensors: list[dict], table: list[dict]):
        """Rows ε, columns γ: every chain's loss trace, a colour per step; each panel's verdict."""
        from reports.plots import plt

        lrs, gammas = self.lrs, self.gammas
        fig, axes = plt.subplots(len(lrs), len(gammas), figsize=(3.4 * len(gammas), 2.6 * len(lrs)), squeeze=False)
        for i, lr in enumerate(lrs):
            for j, gamma in enumerate(gammas):
                key, ax = setting_key(lr, gamma), axes[i, j]
                for k, (row, traces) in enumerate(zip(rows, tensors, strict=True)):
                    for c, chain in enumerate(traces.get(key, [])):
                        ax.plot(
                            chain.numpy(), color=f"C{k}", lw=0.6, alpha=0.7, label=None if c else f"step {row['step']}"
                        )
                verdict = "passes" if all(self.passes(row, key) for row in rows) else "fails"
                ax.set_title(
                    f"ε {lr:g}, γ {gamma:g}: {verdict}", fontsize=9, color="k" if verdict == "passes" else "tab:red"
                )
                ax.grid(alpha=0.3)
                if i == len(lrs) - 1:
                    ax.set_xlabel("draw")
                if j == 0:
                    ax.set_ylabel("nβ (L_B(w) − L_B(w*))")
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"{self.request.run_dir.name}: SGLD loss traces (each line a chain)")
        fig.tight_layout()
        return fig

    def report(self, conclusion: Conclusion) -> None:
        chosen, m = conclusion.result["pick"], self.cfg.model
        if chosen is None:
            table = conclusion.tables[CALIBRATION_TABLE]
            failing = steps_none_pass(table)
            rest = [r for r in table if r["step"] not in failing]
            without = pick(rest) if rest else None
            where = f" (none at step {', '.join(map(str, failing))})" if failing else ""
            those = "that step" if len(failing) == 1 else "those steps"
            otherwise = (
                f"; without {those} ε {without['lr']:g}, γ {without['localization']:g} would be the pick"
                f" (--steps {','.join(str(s) for s in sorted({r['step'] for r in rest}))})"
                if without
                else ""
            )
            print(
                f"{self.kind}: no setting passes at every step{where}{otherwise}: raise stages.llc.draws, or try other"
                " --lr / --localization"
            )
            return
        print(
            f"{self.kind}: pick ε {chosen['lr']:g}, γ {chosen['localization']:g}"
            f" (stages.llc.lr={chosen['lr']:g} stages.llc.localization={chosen['localization']:g}"
            f" stages.llc.calibrated_on=[{m.n_layers},{m.n_heads},{m.d_model},{m.d_head}])"
        )


if __name__ == "__main__":
    sys.exit(main(CalibrateLLC, description=__doc__.split("\n\n")[0]))
