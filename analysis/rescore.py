"""Re-score a finished run from its saved weights, with tracker options it did not train with.

    python -m analysis.rescore RUN_DIR "tracker.measures=[subspace,token_space]"
    python -m analysis.rescore RUN_DIR tracker.ablation.kind=resample --steps 300:600
    python -m analysis.rescore RUN_DIR tracker.probe_batch_size=64 --every 2 --name probe64
    python -m analysis.rescore multirun/2026-11-23/10-00-00 "tracker.measures=[subspace]"   # every job, then the sweep report

Every selected saved step (``RUN_DIR/trajectory/``) is measured by the tracker's own snapshot code
(:meth:`callbacks.tracker.CompositionTracker.measure`), with every part the tracker options turn on
(a part's ``every_n_steps`` > 0) at every step; heatmaps keep their period. The outputs are those of
a run, under ``RUN_DIR/analysis/NAME/``: ``csv/metrics.csv`` (the same keys), ``tensors/``, the
figures (where the run drew its own: not after ``figures=false``, when ``python -m reports.run_report
RUN_DIR/analysis/NAME`` draws them), ``summary.json``, the validity table, and a W&B run (``job_type=analysis``) in the training
run's group (its sweep's, or one named after the run); W&B is offline unless the run's config or
``$WANDB_MODE`` says otherwise; and, last, ``analysis.json`` (the request and the summary), through
:mod:`analysis.protocol`. Nothing outside ``analysis/NAME/`` is written, and an existing analysis
is never replaced unless ``--overwrite`` is given.
"""

from __future__ import annotations

import re
import sys

from omegaconf import DictConfig

from analysis.protocol import Analysis, Conclusion, main
from analysis.saved_run import Request
from conf.validate import tracker_problems
from records.trajectory import Trajectory


class Rescore(Analysis):
    """The tracker's snapshot at every selected step, every part the tracker options turn on."""

    kind = "rescore"
    section = "tracker"
    example = "tracker.ablation.kind=resample"
    run_like = True

    @classmethod
    def check(cls, cfg: DictConfig, options: dict) -> list[str]:
        """The tracker options checked as ``train.py`` checks them (the tracker on, whatever the run had)."""
        cfg.tracker.enabled = True
        return tracker_problems(cfg)

    @classmethod
    def default_name(cls, overrides: list[str], spec: str, every: int) -> str:
        """A directory name from the overrides and the step selection: ``measures=subspace+token_space``."""
        parts = [
            o.lstrip("+").removeprefix("tracker.").replace("[", "").replace("]", "").replace(",", "+")
            for o in overrides
        ]
        if spec != "all":
            parts.append(f"steps={spec.replace(':', '-').replace(',', '+')}")
        if every > 1:
            parts.append(f"every={every}")
        name = re.sub(r"[^A-Za-z0-9._=+-]", "_", ",".join(parts))[:120]
        return name or cls.kind

    def __init__(self, request: Request) -> None:
        from callbacks.tracker import tracker_from_config  # heavy imports only once the request is known to be good

        super().__init__(request)
        self.tracker = tracker_from_config(request.cfg, request.out_dir).rescoring()
        self.tracker.cost_report = False

    def describe(self) -> str:
        parts = []
        for quantity in self.tracker.quantities:
            if quantity.name == "composition":
                measures = quantity.options.measures
                parts.append(f"{len(measures)} measure{'s' * (len(measures) != 1)} ({', '.join(measures)})")
            elif quantity.name == "ablation":
                parts.append(f"ablation ({quantity.options.method}, {quantity.options.kind})")
            elif quantity.every_n_steps is not None and quantity.rescored_every_step:
                parts.append(quantity.label or quantity.name)
        return ", ".join(parts) + f", probe of {self.tracker.probe.tokens.shape[0]} sequences"

    def start(self, loggers: list) -> None:
        self.loggers = loggers
        first = self.request.steps[0]
        self.tracker.open(Trajectory(self.request.run_dir).model(first, self.request.torch_device), first)

    def measure(self, step: int, model) -> tuple[dict, dict]:
        """The snapshot, logged by the tracker itself (CSV, tensor store, W&B) as during training."""
        self.tracker.snapshot(self.loggers, model, step, last=step == self.request.steps[-1])
        return {}, {}

    def conclude(self, rows: list[dict], tensors: list[dict]) -> Conclusion:
        """The run's report (validity table, summary, and its figures where the run drew its own) over the
        re-scored steps."""
        from reports.publish import publish_report

        self.tracker.close()
        request = self.request
        window, figures = request.cfg.tracker.smoothing_window, request.cfg.figures
        report = publish_report(request.out_dir, self.loggers, request.steps[-1], window, figures)
        return Conclusion(result=report.summary if report is not None else {})


if __name__ == "__main__":
    sys.exit(main(Rescore, description=__doc__.split("\n\n")[0]))
