"""The composition tracker: every N optimizer steps, measure the model and log to every logger.

The cheap parts (the probe pass, head scores, loss views and the dense measures, Frobenius by
default) run at every measured step; each expensive part (every other measure, the ablation,
copying scores, matching, heatmaps and the whitened bases) on its own schedule. Early in the run
the tracker prints what one snapshot costs, part by part, and the overhead that implies; at the end,
how long it spent measuring and drawing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import Logger, WandbLogger

from data.probe import ProbeBatch
from metrics.composition.baseline import cache_directory, random_baselines
from metrics.composition.engine import DEFAULT_CHUNK_BYTES, composition_flops
from metrics.composition.whitening import Whitening
from metrics.snapshot import Snapshot, take_snapshot
from records.keys import snapshot_metrics
from records.layout import TENSORS_DIR
from records.tensor_store import TensorStore, snapshot_tensors
from reports.plots import heatmap_image

WITH_ALL = "composition of every measure"
"""The ledger's name for the composition of a snapshot that scores every tracked measure, not only the dense ones."""

DENSE_MEASURES = ("frobenius",)
"""The measures scored at every snapshot by default: the cheapest (Gram products, no factorisation)
and the one the papers plot. The others are scored every ``Schedule.all_measures`` steps."""
SMALL_SNAPSHOT_FLOPS = 1e9  # below this, a snapshot is many small ops: one thread is faster than two


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


@dataclass
class CostLedger:
    """Seconds spent per part, and how often each ran, for the cost report."""

    seconds: dict[str, float] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)  # the most recent run's seconds, per part

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds
        self.runs[part] = self.runs.get(part, 0) + 1
        self.last[part] = seconds


class CompositionTracker(L.Callback):
    """Logs composition, head scores and loss views on the probe batch every ``schedule.every_n_steps``.

    Runs on global rank 0 only, under ``no_grad``, restoring the model's train/eval mode; it draws
    no random numbers, so training is identical with and without it. Measures at step 0 (before the
    first update), after every ``every_n_steps``-th optimizer step, and at the last step (every
    part, whatever its schedule).
    """

    def __init__(
        self,
        probe: ProbeBatch,
        schedule: Schedule,
        measures: tuple[str, ...] = ("frobenius",),
        dense_measures: tuple[str, ...] = DENSE_MEASURES,
        baseline_samples: int = 2000,
        ablation_method: str = "auto",
        ablation_kind: str = "per_position",
        run_dir: Path | None = None,
        store: bool = True,
        max_pair_keys: int = 300,
        top_pairs: int = 3,
        dtype: torch.dtype | None = None,
        num_threads: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cost_report: bool = True,
    ) -> None:
        self.probe = probe
        self.schedule = schedule
        self.every_n_steps = self.schedule.every_n_steps
        self.measures = measures
        self.dense_measures = tuple(m for m in measures if m in dense_measures)  # scored at every snapshot
        self.baseline_samples = baseline_samples
        self.ablation_method, self.ablation_kind = ablation_method, ablation_kind
        self.store_dir = Path(run_dir) / TENSORS_DIR if (store and run_dir is not None) else None
        self.store: TensorStore | None = None
        self.max_pair_keys, self.top_pairs = max_pair_keys, top_pairs
        self.dtype, self.num_threads, self.chunk_bytes = dtype, num_threads, chunk_bytes
        self.cost_report = cost_report
        self.ledger = CostLedger()
        self.last_step: int | None = None
        self.last_keys: list[str] = []  # the keys of the last snapshot: an unmeasurable one logs NaN under them
        self.latest: tuple[int, dict[str, float]] | None = (
            None  # (step, metrics) of the last snapshot, for other callbacks
        )
        self.whitenings: dict = {}  # the whitened bases (embedding, residual), reused between refreshes
        self.ablation_used: str | None = None
        self._clock: tuple[int, float, float] | None = (
            None  # (step, time, tracker seconds so far) when the clock started
        )
        self._reported = False

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
        if trainer.is_global_zero and self.cost_report and self.ledger.runs:
            print(self.totals_line())

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
            if not all(bool(p.detach().isfinite().all()) for p in model.parameters()):
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
        )
        self.whitenings = snap.whitenings
        self.ablation_used = snap.ablation_method or self.ablation_used
        for part, seconds in snap.seconds.items():
            # a snapshot that scores every measure is booked apart: the others run on their own schedule
            self.ledger.add(WITH_ALL if part == "composition" and measures != self.dense_measures else part, seconds)
        logging_start = time.perf_counter()
        metrics = snapshot_metrics(snap, self.max_pair_keys, self.top_pairs, n_measures=len(self.measures))
        self.last_keys = list(metrics)
        self.latest = (step, metrics)
        for logger in loggers:
            logger.log_metrics(metrics, step=step)
        if self.store is not None:
            self.store.append(step, snapshot_tensors(snap))
        self.ledger.add("logging", time.perf_counter() - logging_start)
        self.ledger.add("snapshot", time.perf_counter() - start)
        if s.due("images", step, last):
            self.log_heatmaps(loggers, snap, step)
        if self.cost_report:
            self.maybe_report(step)
        return snap

    def log_heatmaps(self, loggers: list[Logger], snap: Snapshot, step: int) -> None:
        wandb_loggers = [lg for lg in loggers if isinstance(lg, WandbLogger)]
        if not wandb_loggers or snap.circuit is None:
            return  # only W&B shows images; one layer has no pairs to draw
        start = time.perf_counter()
        for measure in snap.composition:
            scores = {kind: snap.minus_baseline(measure, kind).float().numpy() for kind in snap.composition[measure]}
            rgb = heatmap_image(scores)
            caption = f"{measure} minus baseline, step {step}: rows writers, columns readers (Q | K | V)"
            for logger in wandb_loggers:
                logger.log_image(key=f"images/composition/{measure}", images=[rgb], step=step, caption=[caption])
        self.ledger.add("images", time.perf_counter() - start)

    # --- what it costs -------------------------------------------------------------------------

    def maybe_report(self, step: int) -> None:
        """At the first snapshot, start the clock; at the second, print the cost report (once)."""
        now = time.perf_counter()
        spent = self.ledger.seconds.get("snapshot", 0.0) + self.ledger.seconds.get("images", 0.0)
        if self._clock is None:
            self._clock = (step, now, spent)
            return
        if self._reported or step == self._clock[0]:
            return
        first_step, first_time, first_spent = self._clock
        training = now - first_time - (spent - first_spent)  # wall time since, less the tracker's own
        step_seconds = max(training, 1e-9) / (step - first_step)
        print(self.cost_lines(step_seconds))
        self._reported = True

    def amortised_seconds_per_step(self, seconds: dict[str, float] | None = None) -> dict[str, float]:
        """Each part's cost per training step: its seconds per run (default: the last run's) over its
        period. Heatmaps drawn only once so far are left out: the first drawing pays W&B's one-time set-up."""
        s, last = self.schedule, self.ledger.last if seconds is None else seconds
        composition, others = self.composition_seconds(last)
        base = composition + sum(last.get(p, 0.0) for p in ("probe", "head scores", "logging"))
        per_step = {"snapshot": base / s.every_n_steps}
        if others:
            per_step["other measures"] = others / s.all_measures
        for part, every in (
            ("ablation", s.ablation),
            ("validity", s.ablation),
            ("copying", s.copying),
            ("matching", s.matching),
            ("images", s.images),
        ):
            if every and part in last and not (part == "images" and seconds is None and self.first_heatmaps_only):
                per_step[part] = last[part] / every
        return per_step

    @property
    def first_heatmaps_only(self) -> bool:
        """Whether the heatmaps have been drawn once only (their seconds include W&B's one-time set-up)."""
        return self.ledger.runs.get("images", 0) == 1

    def composition_seconds(self, last: dict[str, float]) -> tuple[float, float]:
        """Seconds of a snapshot's composition at every snapshot (the dense measures), and the extra
        seconds of every other measure where they run on their own schedule (0 where they run at
        every snapshot or none is tracked)."""
        dense, full = last.get("composition"), last.get(WITH_ALL)
        if full is None:
            return dense or 0.0, 0.0
        if dense is None or not self.schedule.all_measures:
            return full, 0.0
        return dense, max(full - dense, 0.0)

    def cost_lines(self, step_seconds: float) -> str:
        """The cost report: a snapshot's parts and their schedules, and the expected overhead."""
        s, last = self.schedule, self.ledger.last
        ms = lambda part: f"{1000 * last[part]:.1f} ms" if part in last else "n/a"
        per_step = self.amortised_seconds_per_step()
        overhead = sum(per_step.values()) / step_seconds
        ablation = f"{ms('ablation')} ({self.ablation_used})" if self.ablation_used else ms("ablation")
        heatmaps = f"heatmaps {ms('images')} every {s.images or 'never'}"
        if self.first_heatmaps_only:
            heatmaps = f"heatmaps every {s.images} (the first took {ms('images')} with W&B's one-time set-up; not in the estimate)"
        composition, others = self.composition_seconds(last)
        scored = len(self.dense_measures) if others else len(self.measures)
        lines = [
            f"tracker cost: a snapshot every {s.every_n_steps} steps costs"
            f" {1000 * (last.get('probe', 0) + last.get('head scores', 0) + composition + last.get('logging', 0)):.1f} ms"
            f" (probe {ms('probe')}, composition {1000 * composition:.1f} ms for {scored} measure{'s' * (scored != 1)}, logging {ms('logging')});",
            *(
                [
                    f"  the {len(self.measures) - scored} other measures {1000 * others:.1f} ms more every {s.all_measures}"
                ]
                if others
                else []
            ),
            f"  ablation {ablation} every {s.ablation or 'never'}, matching {ms('matching')} every {s.matching or 'never'},"
            f" copying scores {ms('copying')} every {s.copying or 'never'}, {heatmaps}",
            f"  training {1000 * step_seconds:.1f} ms/step -> expected tracker overhead {overhead:.1%}"
            + ("" if overhead < 0.25 else " (high: raise tracker.every_n_steps or the expensive parts' every_n_steps)"),
        ]
        return "\n".join(lines)

    def totals_line(self) -> str:
        seconds, runs = self.ledger.seconds, self.ledger.runs
        images = f", heatmaps {seconds['images']:.1f} s ({runs['images']} times)" if "images" in seconds else ""
        return (
            f"tracker: {runs.get('snapshot', 0)} snapshots in {seconds.get('snapshot', 0):.1f} s"
            f" (composition {seconds.get('composition', 0) + seconds.get(WITH_ALL, 0):.1f} s, ablation {seconds.get('ablation', 0):.1f} s){images}"
        )
