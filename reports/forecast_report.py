"""What a run forecast of its own phase change (callbacks/phase_change_forecast.py), read back from its
CSV log: the forecasts made at 25 / 50 / 75 % of the way to the midpoint the run report found, for
``summary.json`` (``forecast/at_25/midpoint_step``, ...) and the report's closing line."""

from __future__ import annotations

import math

import numpy as np

from metrics.dynamics.forecast import FORECAST_KEYS, WAYS, Forecast, forecast_at

FIELDS = ("midpoint_step", "low", "high", "p_before_end")


def logged_forecasts(series: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[Forecast]:
    """Every forecast in a run's series (``{key: (steps, values)}``), in step order; a snapshot that
    logged no midpoint (the fall not growing) has ``inf``."""
    if FORECAST_KEYS[-1] not in series:
        return []
    columns = {key: dict(zip(*series[key])) if key in series else {} for key in FORECAST_KEYS}
    steps, _ = series[FORECAST_KEYS[-1]]
    return [
        Forecast(
            float(t),
            *(float(columns[key].get(t, math.inf)) for key in FORECAST_KEYS[:3]),
            columns[FORECAST_KEYS[-1]][t],
        )
        for t in steps
    ]


def forecast_summary(series, midpoint: float | None) -> dict[str, float]:
    """``forecast/at_{25,50,75}/{step, midpoint_step, low, high, p_before_end}``: the last forecast made by
    that fraction of the way to ``midpoint`` (none yet: left out); without a midpoint, the run's last
    forecast as ``forecast/last/*``."""
    forecasts = logged_forecasts(series)
    if not forecasts:
        return {}
    chosen = {f"at_{way * 100:.0f}": forecast_at(forecasts, way * midpoint) for way in WAYS} if midpoint else {}
    if midpoint is None:
        chosen["last"] = forecasts[-1]
    summary = {}
    for name, f in chosen.items():
        if f is not None:
            summary[f"forecast/{name}/step"] = f.step
            summary.update(
                {f"forecast/{name}/{k}": v for k, v in zip(FIELDS, (f.midpoint, f.low, f.high, f.p_before_end))}
            )
    return summary


def forecast_line(summary: dict) -> str | None:
    """One line: what was forecast at 25 / 50 / 75 % of the way to the midpoint found (or the last forecast)."""

    def said(name: str) -> str:
        step, m = summary[f"forecast/{name}/step"], summary[f"forecast/{name}/midpoint_step"]
        p = summary[f"forecast/{name}/p_before_end"]
        if not math.isfinite(m):
            return f"at step {step:.0f}, none yet (the fall not growing; p_before_end {p:.2f})"
        low, high = summary[f"forecast/{name}/low"], summary[f"forecast/{name}/high"]
        return f"at step {step:.0f}, {m:.0f} [{low:.0f}, {high:.0f}] (p_before_end {p:.2f})"

    if "forecast/last/step" in summary:
        return f"forecast: no phase change by the last step; the last forecast, {said('last')}"
    midpoint = summary.get("phase_change/loss_midpoint_step")
    if midpoint is None or not any(k.startswith("forecast/at_") for k in summary):
        return None
    parts = [
        f"{way:.0%} of the way {said(name)}" if f"forecast/{name}/step" in summary else f"{way:.0%}: none made yet"
        for way in WAYS
        for name in [f"at_{way * 100:.0f}"]
    ]
    return f"forecast of the midpoint ({midpoint:.0f}): " + "; ".join(parts)
