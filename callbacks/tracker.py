"""The composition tracker: every N optimizer steps, measure the model and log to every logger.

The cheap parts (the probe pass, head scores, loss views and the dense measures, Frobenius by
default) run at every measured step; each expensive part (every other measure, the ablation,
copying scores, matching, heatmaps and the whitened bases) on its own schedule. Early in the run
the tracker prints what one snapshot costs, part by part, and the overhead that implies; at the end,
how long it spent measuring and drawing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import Logger, WandbLogger

from callbacks.divergence import largest_magnitude
from data.probe import ProbeBatch
from metrics.composition.baseline import cache_directory, random_baselines
from metrics.composition.engine import composition_flops
from metrics.composition.whitening import Whitening
from metrics.snapshot import Snapshot, take_snapshot, without_interventions
from records.keys import INTERVENTION_OFF, snapshot_metrics
from records.layout import TENSORS_DIR
from records.tensor_store import TensorStore, snapshot_tensors
from reports.plots import heatmap_image
from reports.tracker_cost import WITH_ALL, TrackerCost

SMALL_SNAPSHOT_FLOPS = 1e9  # below this, a snapshot is many small ops: one thread is faster than two


def _name(option) -> str:
    """An option's name, whether the config gives it as an Enum or a string."""
    return str(getattr(option, "value", option))


def auto_threads(shape, measures: tuple[str, ...]) -> int:
    """Torch threads for a snapshot when none are configured: 1 for small models, whose snapshot is
    hundreds of tiny ops where waking a second thread costs more than it saves (measured: 6 vs 9 ms
    at the default shape), else as many as training uses (the pair GEMMs of big models scale)."""
    flops = composition_flops(shape.n_layers, shape.n_heads, shape.d_model, shape.d_head, measures)
    return 1 if flops < SMALL_SNAPSHOT_FLOPS else torch.get_num_threads()


@dataclass
class Schedule:
    """Steps between runs of each part (0: never); every one a multiple of ``every_n_steps``.

    ``all_measures``: every tracked measure, not only the dense ones, scored at these steps and at
    every ablation step (0: at every snapshot). ``whitening``: the whitened bases (of ``whitened``,
    ``whitened_resid``, ``token_space``) recomputed, reused in between (0: recomputed whenever scored)."""

    every_n_steps: int
    ablation: int
    copying: int
    matching: int
    images: int
    all_measures: int
    whitening: int

    @classmethod
    def of(cls, settings) -> Schedule:
        """The schedule of the config's ``tracker`` section."""
        return cls(
            every_n_steps=settings.every_n_steps,
            ablation=settings.ablation.every_n_steps,
            copying=settings.copying.every_n_steps,
            matching=settings.matching.every_n_steps,
            images=settings.images.every_n_steps,
            all_measures=settings.all_measures.every_n_steps,
            whitening=settings.whitening.every_n_steps,
        )

    def due(self, part: str, step: int, last: bool) -> bool:
        every = getattr(self, part)
        return bool(every) and (step % every == 0 or last)

    def at_every_step(self) -> Schedule:
        """For chosen steps (a re-scoring of saved weights): every part that is on runs at each one,
        every measure is scored and the whitened bases come from that step; heatmaps keep their period."""
        on = lambda every: 1 if every else 0
        return Schedule(
            every_n_steps=1,
            ablation=on(self.ablation),
            copying=on(self.copying),
            matching=on(self.matching),
            images=self.images,
            all_measures=0,
            whitening=0,
        )


class CompositionTracker(L.Callback):
    """Logs composition, head scores and loss views on the probe batch every ``schedule.every_n_steps``.

    Runs on global rank 0 only, under ``no_grad``, restoring the model's train/eval mode; it draws
    no random numbers, so training is identical with and without it. Measures at step 0 (before the
    first update), after every ``every_n_steps``-th optimizer step, and at the last step (every
    part, whatever its schedule).
    """

    def __init__(self, probe: ProbeBatch, settings, run_dir: Path | None = None) -> None:
        """``settings``: the config's ``tracker`` section (``conf/schema.py``, ``TrackerConfig``; its
        every default is there); ``run_dir``: where the tensor store goes (None: no store)."""
        self.probe = probe
        self.schedule = Schedule.of(settings)
        self.every_n_steps = self.schedule.every_n_steps
        self.measures = tuple(settings.measures)
        self.share = (settings.share_rows, settings.share_centre, settings.share_floor)
        self.dense_measures = tuple(m for m in self.measures if m in settings.dense_measures)  # at every snapshot
        self.baseline_samples = settings.baseline_samples
        self.ablation_method = _name(settings.ablation.method)
        self.ablation_kind = _name(settings.ablation.kind)
        self.store_dir = Path(run_dir) / TENSORS_DIR if (settings.store and run_dir is not None) else None
        self.store: TensorStore | None = None
        self.max_pair_keys, self.top_pairs = settings.max_pair_keys, settings.top_pairs
        self.dtype = torch.float64 if _name(settings.precision) == "float64" else None
        self.num_threads = settings.num_threads
        self.chunk_bytes = settings.chunk_mb * 2**20
        self.cost_report = settings.cost_report
        self.cost = TrackerCost(self.schedule, self.measures, self.dense_measures)
        self.last_step: int | None = None
        self.last_keys: list[str] = []  # the keys of the last snapshot: an unmeasurable one logs NaN under them
        self.latest: tuple[int, dict[str, float]] | None = (
            None  # (step, metrics) of the last snapshot, for other callbacks
        )
        self.whitenings: dict = {}  # the whitened bases (embedding, residual), reused between refreshes
        self.ablation_used: str | None = None

    def state_dict(self) -> dict:
        """What a resumed run needs to measure exactly as an uninterrupted one: the whitened bases in
        use since their last refresh (``{basis: {"half", "inverse_half"}}``, ``[d_model, d_model]`` each)."""
        return {
            "whitenings": {
                basis: {"half": w.half, "inverse_half": w.inverse_half} for basis, w in self.whitenings.items()
            }
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.whitenings = {basis: Whitening(**w) for basis, w in state_dict.get("whitenings", {}).items()}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.open(pl_module.model, trainer.global_step)
        self.maybe_measure(trainer, pl_module)

    def open(self, model, first_step: int) -> None:
        """Get ready to measure ``model`` from ``first_step`` on: the snapshot's threads, the random
        baselines (sampled once per shape and cached on disk: a one-time cost, so it is paid here and
        left out of the cost report's estimate), and the tensor store, cut back to before
        ``first_step`` (a resumed run measures its first step again)."""
        if self.num_threads is None:
            self.num_threads = auto_threads(model.shape, self.measures)
        started = time.perf_counter()
        random_baselines(model.shape.d_model, model.shape.d_head, self.baseline_samples)
        if (seconds := time.perf_counter() - started) > 1.0:
            print(
                f"random baselines for d_model {model.shape.d_model}, d_head {model.shape.d_head}: sampled once in {seconds:.1f} s"
                f" (cached in {cache_directory()})"
            )
        if self.store_dir is not None:
            self.store = TensorStore(self.store_dir)
            self.store.truncate_after(first_step - 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.maybe_measure(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.maybe_measure(trainer, pl_module, force=True)  # the final weights, whatever max_steps is
        self.close()
        if trainer.is_global_zero and self.cost_report and self.cost.ledger.runs:
            print(self.cost.totals_line())

    def maybe_measure(self, trainer: L.Trainer, pl_module: L.LightningModule, force: bool = False) -> None:
        step = trainer.global_step
        last = force or 0 < trainer.max_steps <= step  # the last step: measure everything, images too
        due = last or step % self.every_n_steps == 0
        if not due or step == self.last_step or not trainer.is_global_zero:
            return  # gradient accumulation calls us several times per optimizer step
        self.last_step = step
        self.snapshot(trainer.loggers, pl_module.model, step, last)

    def snapshot(self, loggers: list[Logger], model, step: int, last: bool) -> None:
        """Measure ``model`` at ``step`` on the tracker's threads (see :meth:`measure`); weights that
        cannot be measured are logged as NaN, with the reason printed."""
        threads = torch.get_num_threads()
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            if not bool(largest_magnitude(model.parameters()).isfinite()):
                self.log_unmeasurable(loggers, step, "the weights are not finite")
            else:
                try:
                    self.measure(loggers, model, step, last)
                except torch.linalg.LinAlgError as error:  # finite but extreme weights: no decomposition converges
                    self.log_unmeasurable(loggers, step, f"a decomposition failed ({str(error).splitlines()[0][:120]})")
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def log_unmeasurable(self, loggers: list[Logger], step: int, why: str) -> None:
        """A snapshot that cannot be taken is logged as NaN under the last snapshot's keys, and said why."""
        print(f"tracker: step {step} not measured, logged as NaN: {why}")
        metrics = {key: float("nan") for key in self.last_keys}
        metrics["tracker/unmeasurable"] = 1.0
        for logger in loggers:
            logger.log_metrics(metrics, step=step)

    def measure(self, loggers: list[Logger], model, step: int, last: bool) -> Snapshot:
        """Take the snapshot due at ``step`` (``last``: every part), log it to ``loggers`` and the
        store. The one code path of every snapshot: in training, and when re-scoring saved weights."""
        start = time.perf_counter()
        s = self.schedule
        ablate = s.due("ablation", step, last)
        every_measure = (
            ablate or not s.all_measures or s.due("all_measures", step, last)
        )  # the ablation judges every measure
        measures = self.measures if every_measure else self.dense_measures
        if s.due("whitening", step, last) or not s.whitening:
            self.whitenings = {}
        snap = take_snapshot(
            model,
            self.probe,
            measures,
            self.baseline_samples,
            ablate=ablate,
            ablation_method=self.ablation_method,
            ablation_kind=self.ablation_kind,
            copying=s.due("copying", step, last),
            matching=s.due("matching", step, last) or ablate,
            whitenings=self.whitenings,
            dtype=self.dtype,
            max_chunk_bytes=self.chunk_bytes,
            share=self.share,
        )
        self.whitenings = snap.whitenings
        self.ablation_used = snap.ablation_method or self.ablation_used
        for part, seconds in snap.seconds.items():
            # a snapshot that scores every measure is booked apart: the others run on their own schedule
            self.cost.ledger.add(
                WITH_ALL if part == "composition" and measures != self.dense_measures else part, seconds
            )
        logging_start = time.perf_counter()
        metrics = snapshot_metrics(snap, self.max_pair_keys, self.top_pairs, measures=self.measures)
        if model.intervened:  # a training-time intervention is on: the same scores without it
            metrics.update({INTERVENTION_OFF + k: v for k, v in without_interventions(model, self.probe).items()})
        self.last_keys = list(metrics)
        self.latest = (step, metrics)
        for logger in loggers:
            logger.log_metrics(metrics, step=step)
        if self.store is not None:
            self.store.append(step, snapshot_tensors(snap))
        self.cost.ledger.add("logging", time.perf_counter() - logging_start)
        self.cost.ledger.add("snapshot", time.perf_counter() - start)
        if s.due("images", step, last):
            self.log_heatmaps(loggers, snap, step)
        if self.cost_report and (report := self.cost.report_once(step, self.ablation_used)):
            print(report)
        return snap

    def log_heatmaps(self, loggers: list[Logger], snap: Snapshot, step: int) -> None:
        wandb_loggers = [lg for lg in loggers if isinstance(lg, WandbLogger)]
        if not wandb_loggers or snap.circuit is None:
            return  # only W&B shows images; one layer has no pairs to draw
        start = time.perf_counter()
        for measure, by_kind in snap.composition.items():
            baseline = snap.baselines.get(measure)  # none for the data-aware share
            scores = {kind: (s - baseline.mean if baseline else s).float().numpy() for kind, s in by_kind.items()}
            rgb = heatmap_image(scores)
            what = f"{measure} minus baseline" if baseline else measure
            caption = f"{what}, step {step}: rows writers, columns readers (Q | K | V)"
            for logger in wandb_loggers:
                logger.log_image(key=f"images/composition/{measure}", images=[rgb], step=step, caption=[caption])
        self.cost.ledger.add("images", time.perf_counter() - start)
