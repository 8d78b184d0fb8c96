"""The tracker's own options: when it measures, on which probe, in which precision, and how much of
each snapshot it writes (each tracked quantity's options are its own, beside its class)."""

from __future__ import annotations

from dataclasses import dataclass

from metrics.composition.engine import DEFAULT_CHUNK_BYTES
from metrics.dynamics.phase_change import SMOOTHING_WINDOW

PRECISIONS = ("model", "float64")


@dataclass
class TrackerOptions:
    """The tracker's own options (``tracker.*``; each tracked quantity's are its own, ``tracker.NAME.*``)."""

    enabled: bool = True
    every_n_steps: int = 10  # a snapshot every this many steps, at step 0 and at the last step
    # per-pair W&B/CSV keys while they number at most this (the quantities' pair_keys per pair: records/keys.py);
    # summaries beyond
    max_pair_keys: int = 300
    top_pairs: int = 3  # pairs logged per family beyond max_pair_keys
    max_head_keys: int = 32  # per-head keys while the model has at most this many heads; the best head beyond
    store: bool = True  # every snapshot's full per-head and per-pair tensors to RUN_DIR/tensors
    precision: str = "model"  # model: the model's dtype, at least float32; float64: exact (not on MPS)
    num_threads: int | None = None  # torch threads while measuring; None: 1 for small models, else as training
    chunk_mb: int = DEFAULT_CHUNK_BYTES // 2**20  # memory bound of one all-pairs product block
    cost_report: bool = True  # print what a snapshot costs and the expected overhead, once, early
    probe_batch_size: int = 16
    # the probe's repeated positions in all: None, probe_batch_size sequences; a number, as many sequences as give
    # at least this many (ceil(positions / block)), so a longer probe is not also a bigger one (experiment=emergence)
    probe_positions: int | None = None
    # the probe's block of first occurrences (and its repeat); None: the task's (Task.probe_block: 16 by default)
    probe_n: int | None = None
    probe_seed: int = 0
    smoothing_window: int = SMOOTHING_WINDOW  # points, for phase-change detection
    # end training 2 spans after the loss's and the induction score's phase changes have ended
    # (callbacks/phase_change_stop.py): for sweeps that time the phase change (experiment=emergence)
    stop_after_phase_change: bool = False
    # forecast the phase change's midpoint at every snapshot before it (callbacks/phase_change_forecast.py):
    # forecast/midpoint_step, low, high (80 %), p_before_end; by the model-free rule, or a fitted forecaster
    forecast: bool = True
    forecaster: str | None = None  # a file of python -m analysis.forecast fit SWEEP_DIR (same task and shape)

    def problems(self) -> list[str]:
        """What is wrong with these values beyond their types, one sentence each (``tracker.`` named)."""
        problems = []
        for key, low in (
            ("every_n_steps", 1),
            ("probe_batch_size", 1),
            ("max_pair_keys", 0),
            ("top_pairs", 0),
            ("max_head_keys", 0),
            ("chunk_mb", 1),
            ("smoothing_window", 1),
        ):
            if getattr(self, key) < low:
                problems.append(f"tracker.{key}={getattr(self, key)} must be >= {low}")
        if self.precision not in PRECISIONS:
            problems.append(f"tracker.precision={self.precision!r} must be one of {PRECISIONS}")
        if self.num_threads is not None and self.num_threads < 1:
            problems.append(f"tracker.num_threads={self.num_threads} must be >= 1 (or null: automatic)")
        if self.probe_positions is not None and self.probe_positions < 1:
            problems.append(f"tracker.probe_positions={self.probe_positions} must be >= 1 (or null: probe_batch_size)")
        if self.probe_n is not None and self.probe_n < 2:
            problems.append(f"tracker.probe_n={self.probe_n} must be >= 2 (or null: half the task's context)")
        return problems
