"""The composition tracker: every N optimizer steps, measure the model and log to every logger.

What it measures are the tracked quantities (:mod:`metrics.tracked`), each on its own schedule: the
cheap ones (the probe pass, head scores, loss views and the dense measures, Frobenius by default)
at every measured step, each expensive one (every other measure, the ablation, copying scores,
matching, heatmaps, the whitened bases) every so many steps. Early in the run the tracker prints what
one snapshot costs, part by part, and the overhead that implies; at the end, how long it spent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig

from callbacks.divergence import largest_magnitude
from conf.objects import build_probe, build_quantities, from_config
from data.probe import ProbeBatch
from metrics.composition.baseline import random_baselines
from metrics.composition.engine import composition_flops
from metrics.disk_cache import cache_directory
from metrics.snapshot import Snapshot, measure
from metrics.tracked.base import Heatmap, TrackedQuantity, with_companions
from metrics.tracked.composition import Heatmaps
from metrics.tracked.options import TrackerOptions
from records.heatmap_pixels import heatmap_image
from records.keys import pair_key_count, snapshot_metrics
from records.layout import TENSORS_DIR
from records.tensor_store import TensorStore, snapshot_labels, snapshot_tensors
from records.tracker_cost import WITH_ALL, TrackerCost

SMALL_SNAPSHOT_FLOPS = 1e9  # below this, a snapshot is many small ops: one thread is faster than two


def auto_threads(shape, measures) -> int:
    """Torch threads for a snapshot when none are configured: 1 for small models, whose snapshot is
    hundreds of tiny ops where waking a second thread costs more than it saves (measured: 5.9 vs 11.8 ms
    at the default shape), else as many as training uses (the pair GEMMs of big models scale)."""
    flops = composition_flops(shape.n_layers, shape.n_heads, shape.d_model, shape.d_head, measures)
    return 1 if flops < SMALL_SNAPSHOT_FLOPS else torch.get_num_threads()


@contextmanager
def openmp_threads(count: int) -> Iterator[None]:
    """Torch's OpenMP threads at ``count`` in this thread while inside, set by OpenMP's own
    ``omp_set_num_threads`` (through threadpoolctl) and given back after. Not ``torch.set_num_threads``:
    that also switches MKL's dynamic threading off for the rest of the process, and every training step
    after it is slower (3-7 % at 4 x 8 x 256 x 32 by ``python -m bench.threads``, 11 % at the default
    shape: docs/operations.md, "Threads"); OpenMP's setting alone leaves MKL as it was. Without a threads switch to make (the
    count already in force, or no OpenMP runtime found), nothing is set."""
    if count == torch.get_num_threads():
        yield
        return
    with thread_pools().limit(limits=count, user_api="openmp"):
        yield


@cache
def thread_pools():
    """threadpoolctl's controller of the thread pools loaded (torch's OpenMP among them): found once,
    0.6 ms, against the few ms a small model's snapshot takes."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


class CompositionTracker(L.Callback):
    """Logs every tracked quantity on the probe batch every ``options.every_n_steps``, each on its schedule.

    Runs on global rank 0 only, under ``no_grad``, restoring the model's train/eval mode; it draws
    no random numbers, so training is identical with and without it. Measures at step 0 (before the
    first update), after every ``every_n_steps``-th optimizer step, and at the last step (every
    quantity, whatever its schedule).
    """

    def __init__(
        self,
        probe: ProbeBatch,
        quantities: list[TrackedQuantity],
        options: TrackerOptions | None = None,
        run_dir: Path | None = None,
    ) -> None:
        """``quantities``: what it measures, in the order they run (``conf.objects.build_quantities``);
        ``run_dir``: where the tensor store goes (None: no store)."""
        self.probe, self.quantities = probe, list(quantities)
        self.options = options = options or TrackerOptions()
        self.every_n_steps = options.every_n_steps
        self.store_dir = Path(run_dir) / TENSORS_DIR if (options.store and run_dir is not None) else None
        self.store: TensorStore | None = None
        self.dtype = torch.float64 if options.precision == "float64" else None
        self.num_threads = options.num_threads
        self.chunk_bytes = options.chunk_mb * 2**20
        self.cost_report = options.cost_report
        self.cost = TrackerCost(self.quantities, self.every_n_steps)
        self.training_clock: float | None = None  # an ensemble member's training seconds so far (its trainer's)
        self.per_pair: bool | None = None  # the run's key mode, fixed at its first snapshot
        self.last_step: int | None = None
        self.last_keys: list[str] = []  # the keys of the last snapshot: an unmeasurable one logs NaN under them
        self.latest: tuple[int, dict[str, float]] | None = None  # (step, metrics) of the last snapshot
        self.ablation_used: str | None = None

    def quantity(self, name: str) -> TrackedQuantity | None:
        return next((q for q in self.quantities if q.name == name), None)

    def due(self, step: int, last: bool) -> set[str]:
        """The quantities measured at ``step``: each on its own schedule, and those that run with one due."""
        return with_companions(self.quantities, {q.name for q in self.quantities if q.due(step, last)})

    def state_dict(self) -> dict:
        """What a resumed run needs to measure exactly as an uninterrupted one: each quantity's state
        (the composition's whitened bases in use since their last refresh)."""
        return {"quantities": {q.name: state for q in self.quantities if (state := q.state_dict())}}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("quantities", {})
        if "whitenings" in state_dict:  # a checkpoint of an earlier version: the tracker held them itself
            saved = {"composition": {"whitenings": state_dict["whitenings"]}}
        for quantity in self.quantities:
            quantity.load_state_dict(saved.get(quantity.name, {}))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.open(pl_module.model, trainer.global_step)
        self.maybe_measure(trainer, pl_module)

    def open(self, model, first_step: int) -> None:
        """Get ready to measure ``model`` from ``first_step`` on: the snapshot's threads, the random
        baselines (sampled once per shape and cached on disk: a one-time cost, so it is paid here and
        left out of the cost report's estimate), each quantity's own one-time work on the probe
        (:meth:`~metrics.tracked.base.TrackedQuantity.prepare`: the head behaviours' random nulls, also
        cached once per machine), and the tensor store, cut back to before ``first_step`` (a resumed run
        measures its first step again)."""
        composition = self.quantity("composition")
        measures = tuple(composition.options.measures) if composition is not None else ()
        if self.num_threads is None:
            self.num_threads = auto_threads(model.shape, measures)
        started = time.perf_counter()
        if composition is not None:
            random_baselines(model.shape.d_model, model.shape.d_head, composition.options.baseline_samples)
        for quantity in self.quantities:
            quantity.prepare(self.probe, model)
        if (seconds := time.perf_counter() - started) > 1.0:
            print(  # most of it the head behaviours' random nulls where the probe is large (the Markov-chain task's)
                f"random baselines and nulls for this shape and probe: computed once in {seconds:.1f} s"
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
            print(self.cost.totals_line(self.training_clock))

    def maybe_measure(self, trainer: L.Trainer, pl_module: L.LightningModule, force: bool = False) -> None:
        step = trainer.global_step
        last = force or 0 < trainer.max_steps <= step  # the last step: measure everything, images too
        due = last or step % self.every_n_steps == 0
        if not due or step == self.last_step or not trainer.is_global_zero:
            return  # gradient accumulation calls us several times per optimizer step
        self.last_step = step
        self.training_clock = getattr(trainer, "training_clock", None)  # see callbacks.ensemble_members.MemberTrainer
        self.snapshot(trainer.loggers, pl_module.model, step, last)

    def snapshot(self, loggers: list[Logger], model, step: int, last: bool) -> None:
        """Measure ``model`` at ``step`` on the tracker's threads (see :meth:`measure`); weights that
        cannot be measured are logged as NaN, with the reason printed."""
        with openmp_threads(self.num_threads):
            if not bool(largest_magnitude(model.parameters()).isfinite()):
                self.log_unmeasurable(loggers, step, "the weights are not finite")
            else:
                try:
                    self.measure(loggers, model, step, last)
                except torch.linalg.LinAlgError as error:  # finite but extreme weights: no decomposition converges
                    self.log_unmeasurable(loggers, step, f"a decomposition failed ({str(error).splitlines()[0][:120]})")

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

    def key_mode(self, model) -> bool:
        """Whether pairs get a key each (see :mod:`records.keys`): decided once, from every tracked
        quantity's keys per pair, whatever a snapshot happens to score."""
        if self.per_pair is None:
            keys_per_pair = sum(q.pair_keys for q in self.quantities if q.applies(model))
            shape = model.shape
            self.per_pair = pair_key_count(shape.n_layers, shape.n_heads, keys_per_pair) <= self.options.max_pair_keys
        return self.per_pair

    def measure(self, loggers: list[Logger], model, step: int, last: bool) -> Snapshot:
        """Take the snapshot due at ``step`` (``last``: everything), log it to ``loggers`` and the
        store. The one code path of every snapshot: in training, and when re-scoring saved weights."""
        start = time.perf_counter()
        snap = measure(
            model,
            self.probe,
            self.quantities,
            self.due(step, last),
            step=step,
            last=last,
            dtype=self.dtype,
            max_chunk_bytes=self.chunk_bytes,
        )
        if (ablation := snap.get("ablation")) is not None:
            self.ablation_used = ablation.method
        composition = snap.get("composition")
        for part, seconds in snap.seconds.items():
            if part == Heatmaps.name:
                continue  # what heatmaps cost is their drawing (log_heatmaps), where there is W&B
            # a snapshot that scores every measure is booked apart: the others run on their own schedule
            every = part == "composition" and composition is not None and not composition.dense
            self.cost.ledger.add(WITH_ALL if every else part, seconds)
        logging_start = time.perf_counter()
        options = self.options
        metrics = snapshot_metrics(
            snap.outputs, snap.circuit, self.key_mode(model), options.top_pairs, options.max_head_keys
        )
        self.last_keys = list(metrics)
        self.latest = (step, metrics)
        for logger in loggers:
            logger.log_metrics(metrics, step=step)
        if self.store is not None:
            self.store.append(step, snapshot_tensors(snap.outputs), snapshot_labels(snap.outputs))
        self.cost.ledger.add("logging", time.perf_counter() - logging_start)
        self.cost.ledger.add("snapshot", time.perf_counter() - start)
        self.log_heatmaps(loggers, [o for o in snap.outputs if isinstance(o, Heatmap)], step)
        if self.cost_report and (report := self.cost.report_once(step, self.ablation_used, self.training_clock)):
            print(report)
        return snap

    def log_heatmaps(self, loggers: list[Logger], heatmaps: list[Heatmap], step: int) -> None:
        """Draw each heatmap and log it to every W&B logger (only W&B shows images)."""
        wandb_loggers = [lg for lg in loggers if isinstance(lg, WandbLogger)]
        if not wandb_loggers or not heatmaps:
            return
        start = time.perf_counter()
        for heatmap in heatmaps:
            rgb = heatmap_image(heatmap.by_kind)
            for logger in wandb_loggers:
                logger.log_image(key=f"images/{heatmap.name}", images=[rgb], step=step, caption=[heatmap.caption])
        self.cost.ledger.add("images", time.perf_counter() - start)

    def rescoring(self) -> CompositionTracker:
        """This tracker for chosen steps (a re-scoring of saved weights): every quantity that is on
        runs at each one, every measure is scored and the whitened bases come from that step;
        heatmaps keep their period."""
        self.quantities = [q.for_rescoring() for q in self.quantities]
        self.every_n_steps = 1
        self.cost = TrackerCost(self.quantities, 1)
        return self


def tracker_from_config(cfg: DictConfig, run_dir: Path | None) -> CompositionTracker:
    """The tracker as ``cfg.tracker`` configures it (``run_dir`` None: no tensor store)."""
    tracker = cfg.tracker
    return CompositionTracker(
        build_probe(cfg), build_quantities(tracker, cfg), from_config(TrackerOptions, tracker), run_dir
    )
