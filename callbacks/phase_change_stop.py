"""End training once the phase change is over (``tracker.stop_after_phase_change``): a sweep that times
the phase change (``experiment=emergence``) need not train far past it.

At every snapshot the tracker's repeated-token loss and top induction score so far go through the run
report's detector (:func:`metrics.dynamics.phase_change.find_phase_change`, with the options of
``summary.json``'s ``phase_change/*``). It reads onset, midpoint and end from the data up to the cliff
and a little after it, so what a longer run would add does not move them (the truncation table of
docs/phase_change_detector.md). The change is over when both series' transitions have ended: the loss
alone can fall in two steps (on short repeated blocks a positional shortcut takes it to about ln of
the number of repeat distances first, the induction circuit later), and its largest fall may be the
first. Both are read again at every snapshot (noise can end a fall that then goes on: its end
moves); once a snapshot is ``margin`` times the longer span (onset to end) past the later end,
training stops through Lightning's public ``trainer.should_stop``, and the run ends as a finished run.
"""

from __future__ import annotations

import lightning as L
import torch

from metrics.dynamics.phase_change import PhaseChange, find_phase_change

SERIES = {"loss/repeated": True, "heads/induction/top": False}  # key: falls (else rises)


class StopAfterPhaseChange(L.Callback):
    """Sets ``trainer.should_stop`` ``margin`` spans after the loss's and the induction score's phase
    changes have both ended. After the tracker in the callback list: it reads the tracker's snapshot of
    the same step (``tracker.latest``). ``min_change``: each series' least move to count (the run report's)."""

    def __init__(self, tracker, min_change: dict[str, float], window: int, margin: float = 2.0) -> None:
        self.tracker, self.min_change, self.window, self.margin = tracker, min_change, window, margin
        self.steps: list[float] = []
        self.values: dict[str, list[float]] = {key: [] for key in SERIES}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        latest = self.tracker.latest
        if latest is None or (self.steps and latest[0] <= self.steps[-1]) or not set(SERIES) <= set(latest[1]):
            return
        step, metrics = latest
        self.steps.append(float(step))
        for key in SERIES:
            self.values[key].append(float(metrics[key]))
        if len(self.steps) < 3:
            return
        found = [
            find_phase_change(
                torch.tensor(self.steps),
                torch.tensor(self.values[key]),
                falling,
                window=self.window,
                min_change=self.min_change.get(key, 0.0),
            )
            for key, falling in SERIES.items()
        ]
        if not all(isinstance(f, PhaseChange) and f.finished for f in found):
            return
        end = max(f.end_step for f in found)
        stop_at = end + self.margin * max(f.end_step - f.onset_step for f in found)
        if step >= stop_at:
            loss = found[0]
            print(
                f"phase change over: the loss's onset {loss.onset_step:.0f}, midpoint {loss.midpoint_step:.0f},"
                f" end {loss.end_step:.0f}; the induction score's end {found[1].end_step:.0f}; training stops"
                f" at step {step} (tracker.stop_after_phase_change: {self.margin:g} spans after the later end)"
            )
            trainer.should_stop = True

    def state_dict(self) -> dict:
        return {"steps": self.steps, "values": self.values}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = list(state_dict["steps"])
        self.values = {key: list(values) for key, values in state_dict["values"].items()}
