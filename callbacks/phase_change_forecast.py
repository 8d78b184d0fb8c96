"""Forecast the phase change from inside the run (``tracker.forecast``, on by default): at every snapshot
until the repeated-token loss has fallen half its first level (its midpoint passed), the midpoint's step
with an 80 % interval and the probability that it comes by ``max_steps``, logged as
``forecast/midpoint_step``, ``forecast/low``, ``forecast/high`` and ``forecast/p_before_end`` beside the
tracker's keys (a key whose value is not finite is left out: no midpoint while the fall is not growing).
By the model-free rule, or by a fitted forecaster (``tracker.forecaster=FILE``):
:mod:`metrics.dynamics.forecast`. The run report reads back what was forecast at 25 / 50 / 75 % of the
way to the midpoint it finds (reports/forecast_report.py); docs/forecast.md says how well each does on
runs it never saw.
"""

from __future__ import annotations

import math

import lightning as L
import numpy as np

from metrics.dynamics.forecast import LOSS, SERIES, Forecaster, past_midpoint, rule_forecast


class PhaseChangeForecast(L.Callback):
    """Forecasts from the tracker's snapshots (``tracker.latest``: after the tracker in the callback list).
    ``forecaster``: a fitted one (None: the rule); ``settings``: the run's resolved config, flattened
    (``{"data.batch_size": "8"}``), for the forecaster's law."""

    def __init__(
        self,
        tracker,
        max_steps: int,
        window: int,
        forecaster: Forecaster | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.tracker, self.max_steps, self.window = tracker, max_steps, window
        self.forecaster, self.settings = forecaster, settings or {}
        self.steps: list[float] = []
        self.values: dict[str, list[float]] = {key: [] for key in SERIES}
        self.passed = False  # the loss has fallen half its first level: nothing left to forecast
        self.logged: tuple[int, dict[str, float]] | None = None  # the last forecast logged, and its step
        self.resumed: tuple[int, dict[str, float]] | None = None  # that one, from a checkpoint: logged again

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        latest = self.tracker.latest
        if latest is not None and self.resumed is not None and latest[0] == self.resumed[0]:
            # a resumed run logs its checkpoint's step again (its rows from that step on were dropped): the
            # forecast made there, as it was, not made twice
            self.log_forecast(trainer, *self.resumed)
        self.resumed = None
        if latest is None or (self.steps and latest[0] <= self.steps[-1]) or LOSS not in latest[1]:
            return
        step, metrics = latest
        self.steps.append(float(step))
        for key in SERIES:
            self.values[key].append(float(metrics.get(key, math.nan)))
        if self.passed or len(self.steps) < 3:
            return
        steps = np.array(self.steps)
        if past_midpoint(np.array(self.values[LOSS]), self.window):
            self.passed = True
            return
        series = {key: np.array(v) for key, v in self.values.items() if not np.isnan(v).any()}
        forecast = (
            self.forecaster.forecast(steps, series, self.max_steps, self.settings)
            if self.forecaster is not None
            else rule_forecast(steps, series[LOSS], self.max_steps, self.window)
        )
        self.log_forecast(trainer, step, {k: v for k, v in forecast.metrics().items() if math.isfinite(v)})

    def log_forecast(self, trainer, step: int, logged: dict[str, float]) -> None:
        """``logged`` at ``step`` to every logger; nothing where no value is finite (no empty row)."""
        if not logged:
            return
        self.logged = (step, logged)
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=step)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "values": self.values, "passed": self.passed, "logged": self.logged}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = list(state_dict["steps"])
        self.values = {key: list(values) for key, values in state_dict["values"].items()}
        self.passed = state_dict["passed"]
        self.resumed = self.logged = state_dict.get("logged")  # checkpoints from before it: none to log again
