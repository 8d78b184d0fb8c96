"""One self-contained page to scrub through training: ``explorer.html`` for a run, and one for a sweep.

A step slider (play/pause, the arrow keys) moves every view at once: the losses and head scores with a
marker at the step; every head's attention pattern on one probe sequence (computed from the
trajectory's weights by :mod:`analysis.explorer_pages`; the command is :mod:`analysis.explorer`);
every head's scores and type; the composition heatmaps (measure and Q/K/V chosen in the page); the
strategies' KLs and mixture weights; the LLC and the stage boundaries an analysis found; interventions'
windows shaded. Hovering a head or a pair shows its numbers. A view the run cannot feed says why
instead.

No server and no network: Plotly's cartesian partial bundle (vendored as npm publishes it, checked
against npm's integrity string) and the data are embedded gzipped and base64-encoded, unpacked by the
browser's own ``DecompressionStream``, so the file opens anywhere, offline, at a third of the size
(1.5 MB of the default run's page against 5.8 MB with Plotly's full bundle inlined). The peer with a
server is MIScope's Dash app (roaringsurfdev/training-dynamics-workbench); pattern-lens and attnview
draw attention patterns alone.

Arrays travel as base64 little-endian float32 (``{"shape": [...], "b64": "..."}``, NaN kept; causal
patterns as their lower triangle); the CSV's curves as JSON numbers, exactly as the CSV holds them, so
the page's read-outs are the run's own numbers. What does not fit the page's budget is subsampled
(steps, then heads), and the page says so.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import json
import math
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metrics.dynamics.forecast import FORECAST_KEYS
from records.layout import (
    ANALYSIS_DIR,
    ANALYSIS_RECORD,
    CSV_RELATIVE_PATH,
    EXPLORER_PAGE,
    LLC_TABLE,
    SUMMARY_NAME,
    TENSORS_DIR,
    DamagedFile,
    run_identity,
    run_label,
)
from records.tensor_store import read_tensor_store
from reports.head_types import read_head_history
from reports.run_report import intervention_windows, plotted_measure, read_series
from reports.strategy_timeline import strategy_names

ASSETS = Path(__file__).with_name("explorer_assets")  # the page's HTML, style and script
PATTERN_BUDGET = 2_400_000  # bytes of float32 for the attention patterns (base64: 4/3 of it in the file)
PAIR_BUDGET = 1_200_000  # ... for the composition and the other per-pair tensors
HEAD_BUDGET = 400_000  # ... for the per-head scores
MAX_PATTERN_HEADS = 16  # heads drawn side by side; more (paper size): spread over the layers
MAX_PATTERN_TOKENS = 64  # the probe sequence's first tokens whose attention is drawn
PAIR_TENSORS = ("ablation/loss_change", "ablation/pattern_change", "match")  # per-pair, not a composition
KINDS = ("Q", "K", "V")
LLC_CURVE = re.compile(
    r"llc_(mean|L\d+(H\d+)?)"
)  # llc.csv's λ̂ of the model, of each layer and each head (weight-refined)


class ExplorerError(ValueError):
    """A path the explorer cannot make a page of (not a run, not a sweep), or no Plotly to inline."""


def packed(array: np.ndarray) -> dict:
    """``{"shape", "b64"}``: ``array`` as little-endian float32 bytes in base64 (NaN kept)."""
    values = np.ascontiguousarray(array, dtype="<f4")
    return {"shape": list(values.shape), "b64": base64.b64encode(values.tobytes()).decode("ascii")}


def plain(values) -> list:
    """Numbers for JSON: NaN and infinities as null (JSON has neither)."""
    return [None if not math.isfinite(v) else v for v in np.asarray(values, dtype=float).tolist()]


def spread(n: int, keep: int) -> np.ndarray:
    """``keep`` indices spread evenly over ``range(n)``, the first and the last among them."""
    if keep >= n:
        return np.arange(n)
    return np.unique(np.round(np.linspace(0, n - 1, max(keep, 1))).astype(int))


def within(steps: np.ndarray, bytes_per_step: int, budget: int, what: str) -> tuple[np.ndarray, str | None]:
    """The indices of ``steps`` kept under ``budget`` bytes, and the note saying so (None: all kept)."""
    keep = spread(len(steps), max(1, budget // max(bytes_per_step, 1)))
    if len(keep) == len(steps):
        return keep, None
    return keep, f"{what}: {len(keep)} of the {len(steps)} measured steps, spread evenly (the page's size budget)"


@dataclass
class Patterns:
    """Every drawn head's attention on one probe sequence at some saved steps (:mod:`analysis.explorer_pages`)."""

    steps: list[int]
    tokens: list[int]  # the probe sequence, [T]
    heads: list[tuple[int, int]]  # (layer, head) of each drawn head
    values: np.ndarray  # [steps, heads, T, T], row = query position, column = key position
    notes: list[str]

    def page(self) -> dict:
        T = len(self.tokens)
        rows, cols = np.tril_indices(T)
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "heads": [f"L{l}H{h}" for l, h in self.heads],
            "tril": packed(self.values[..., rows, cols]),  # [steps, heads, T(T+1)/2], row-major
        }


def pattern_heads(n_layers: int, n_heads: int) -> tuple[list[tuple[int, int]], str | None]:
    """The heads whose patterns are drawn: all, or up to :data:`MAX_PATTERN_HEADS` spread over the layers."""
    every = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    if len(every) <= MAX_PATTERN_HEADS:
        return every, None
    per_layer = max(1, MAX_PATTERN_HEADS // n_layers)
    layers = spread(n_layers, MAX_PATTERN_HEADS) if n_layers > MAX_PATTERN_HEADS else range(n_layers)
    chosen = [(int(l), int(h)) for l in layers for h in spread(n_heads, per_layer)]
    return chosen, f"attention patterns: {len(chosen)} of the {len(every)} heads ({per_layer} a layer, spread evenly)"


def curve_panels(series: dict, measure: str, midpoint: float | None = None) -> list[dict]:
    """The line charts: each ``{"id", "title", "y", "keys"}`` with the CSV keys it draws, and ``levels``
    (``[{"y", "name"}]``: horizontal lines) where it has them: the forecast's panel, the ``midpoint``
    the run report found (None: none)."""
    keys = sorted(series)
    panels = [
        (
            "loss",
            "losses",
            "nats",
            [k for k in keys if k == "train/loss" or (k.startswith("loss/") and k != "loss/icl_score")],
        ),
        (
            "scores",
            "head scores and the circuit pair",
            "score",
            [k for k in keys if k.startswith("heads/") and k.endswith("/top")]
            + [k for k in (f"circuit/K/{measure}", f"circuit/K/{measure}_minus_baseline") if k in series],
        ),
        (
            "strategies_kl",
            "strategies: KL(strategy ‖ model)",
            "nats",
            [k for k in keys if k.startswith("strategies/kl/")],
        ),
        (
            "strategies_weight",
            "strategies: mixture weights",
            "weight",
            [k for k in keys if k.startswith("strategies/weight/")],
        ),
        (
            "llc",
            "local learning coefficient (training time)",
            "λ̂",
            [k for k in keys if k.startswith("llc/") or k == "llc"],
        ),
        (
            "forecast",
            "forecast of the repeated-token loss's midpoint step (80 % interval), made at each step",
            "midpoint step",
            [k for k in FORECAST_KEYS[:3] if k in series],
        ),
    ]
    found = [{"y": midpoint, "name": "the midpoint found"}] if midpoint is not None else []
    return [
        {"id": i, "title": t, "y": y, "keys": ks, **({"levels": found} if i == "forecast" else {})}
        for i, t, y, ks in panels
        if ks
    ]


def top_heads(series: dict, top_key: str) -> list[str]:
    """Which head ``heads/SCORE/top`` is at each of its steps: the head ``heads/SCORE/LxHy`` whose value
    there is nearest the top's ("" where none was logged at that step), for the curve's hover."""
    prefix = top_key[: -len("top")]
    steps, top = series[top_key]
    by_head = {
        key[len(prefix) :]: dict(zip(series[key][0].astype(int).tolist(), series[key][1].tolist()))
        for key in series
        if key.startswith(prefix) and re.fullmatch(r"L\d+H\d+", key[len(prefix) :])
    }
    names = []
    for step, value in zip(steps.astype(int).tolist(), top.tolist()):
        here = {h: v.get(step) for h, v in by_head.items() if v.get(step) is not None and math.isfinite(v[step])}
        names.append(min(here, key=lambda h: abs(here[h] - value)) if here and math.isfinite(value) else "")
    return names


def run_summary(run_dir: Path) -> dict:
    """The run report's ``summary.json`` ({} where there is none or it cannot be read)."""
    try:
        summary = json.loads((run_dir / SUMMARY_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def found_phase_change(summary: dict) -> dict[str, float]:
    """The run report's phase change: ``{"onset", "midpoint", "end"}`` steps, those it found."""
    found = {part: summary.get(f"phase_change/loss_{part}_step") for part in ("onset", "midpoint", "end")}
    return {part: float(step) for part, step in found.items() if isinstance(step, (int, float))}


def happened_line(summary: dict, series: dict) -> str:
    """What happened, in one line: the phase change's steps, the circuit pair, the head types formed and
    when (the step of the switch into each), the strategy switches with their intervals."""
    parts = []
    change = found_phase_change(summary)
    if "midpoint" in change:
        steps = " / ".join(
            f"{change[p]:.0f}" if p in change else "beyond the run" for p in ("onset", "midpoint", "end")
        )
        parts.append(f"phase change {steps} (onset / midpoint / end)")
    else:
        parts.append("no phase change")
    pair = [series.get(f"circuit/{k}") for k in ("writer_layer", "writer_head", "reader_layer", "reader_head")]
    if all(p is not None and len(p[1]) for p in pair):
        wl, wh, rl, rh = (int(p[1][-1]) for p in pair)
        parts.append(f"circuit pair L{wl}H{wh} → L{rl}H{rh}")
    formed = []
    for key in sorted(k for k in summary if k.startswith("heads/type/")):
        head, kind = key.removeprefix("heads/type/"), summary[key]
        if not isinstance(kind, str) or kind == "unspecialised":
            continue
        into = [
            summary.get(f"{k}/step")
            for k in summary
            if k.startswith(f"heads/switch/{head}/") and k.count("/") == 3 and str(summary[k]).endswith(f"→ {kind}")
        ]
        formed.append(f"{head} {kind}" + (f" at {into[-1]:.0f}" if into and isinstance(into[-1], (int, float)) else ""))
    if formed:
        parts.append("heads: " + ", ".join(formed))
    stages = strategy_stages(summary)
    if stages:
        parts.append(
            "strategies: "
            + "; ".join(
                f"{w['from']} → {w['to']} at {w['step']:.0f} [{w['low']:.0f}, {w['high']:.0f}]"
                for w in stages["switches"]
            )
        )
    return "; ".join(parts)


def strategy_stages(summary: dict) -> dict | None:
    """The strategy the model uses at each step, from the run's switch record (``strategies/switch/*``,
    reports/strategy_timeline.py), not the per-snapshot closest, which flickers where two are close:
    ``{"first": name, "switches": [{"to", "step", "low", "high"}]}``; None without a record."""
    count = summary.get("strategies/switches")
    if not isinstance(count, (int, float)):
        return None
    switches = []
    for i in range(1, int(count) + 1):
        name, step = summary.get(f"strategies/switch/{i}"), summary.get(f"strategies/switch/{i}/step")
        if not isinstance(name, str) or "→" not in name or not isinstance(step, (int, float)):
            return None
        before, after = (part.strip() for part in name.split("→", 1))
        low, high = summary.get(f"strategies/switch/{i}/low", step), summary.get(f"strategies/switch/{i}/high", step)
        switches.append({"from": before, "to": after, "step": step, "low": low, "high": high})
    if not switches:
        return None
    return {"first": switches[0]["from"], "switches": switches}


def readouts(series: dict, measure: str) -> list[dict]:
    """The numbers printed at the slider's step: ``{"id", "label", "key"}`` of each CSV key shown."""
    wanted = [
        ("loss", "repeated-token loss", "loss/repeated"),
        ("train_loss", "training loss", "train/loss"),
        ("induction", "top induction score", "heads/induction/top"),
        ("circuit", f"circuit pair's K-composition ({measure})", f"circuit/K/{measure}"),
    ]
    return [{"id": i, "label": label, "key": key} for i, label, key in wanted if key in series]


def closest_strategies(series: dict) -> dict | None:
    """The closest strategy at each strategy reading: the name with the least KL (the truth is not a
    strategy) and the CSV's own ``strategies/closest`` code beside it."""
    names = strategy_names(series)
    if not names or any(f"strategies/kl/{n}" not in series for n in names):
        return None
    steps = series[f"strategies/kl/{names[0]}"][0]
    kls = np.stack([series[f"strategies/kl/{n}"][1] for n in names], axis=1)
    codes = series.get("strategies/closest")
    return {
        "steps": steps.astype(int).tolist(),
        "names": [names[int(i)] for i in np.nanargmin(np.where(np.isnan(kls), np.inf, kls), axis=1)],
        "codes": plain(codes[1]) if codes is not None and len(codes[1]) == len(steps) else None,
    }


def head_maps(store: dict, store_dir: Path, reader: str, budget: int) -> tuple[dict | None, list[str], str | None]:
    """Every head's scores over the snapshots: the store's ``[L, H]`` tensor of each behaviour (``heads/KEY``,
    one a score) and the types (:func:`reports.head_types.read_head_history`). Returns ``(view, notes, why none)``."""
    maps = {
        name: value
        for name, value in store.items()
        if value[1].ndim == 3
        and name.startswith("heads/")
        and not name.startswith(("heads/behaviour/", "heads/writes/"))
    }
    history = read_head_history(store_dir, reader) if store and store_dir.is_dir() else None
    views: dict[str, tuple[np.ndarray, np.ndarray]] = {n.removeprefix("heads/"): v for n, v in maps.items()}
    if not views:
        return None, [], "the run stored no per-head scores (tracker off, or no tensor store)"
    notes, out = [], {}
    per_view = budget // len(views)
    for name, (steps, values) in views.items():
        keep, note = within(steps, values[0].nbytes, per_view, f"head scores ({name})")
        out[name] = {"steps": steps[keep].astype(int).tolist(), "values": packed(values[keep])}
        notes += [note] if note else []
    types = None
    if history is not None:
        keep, _ = within(history.steps, history.types[0].size * 4, per_view, "head types")
        types = {
            "steps": history.steps[keep].astype(int).tolist(),
            "codes": packed(history.types[keep]),
            "names": list(history.type_names),  # the codes index these
        }
    first = next(iter(views.values()))[1]
    return {"layers": first.shape[1], "heads": first.shape[2], "maps": out, "types": types}, notes, None


def pair_maps(store: dict, budget: int) -> tuple[dict | None, list[str], str | None]:
    """The per-pair tensors ``[L, H, L, H]`` (writer, reader) over the snapshots: every composition
    measure under Q, K and V, and the ablation's and matching's tensors. Returns ``(view, notes, why none)``."""
    chosen = {
        name: value
        for name, value in store.items()
        if value[1].ndim == 5 and (name in PAIR_TENSORS or (name.startswith("comp/") and name.split("/")[1] in KINDS))
    }
    if not chosen:
        return None, [], "the run stored no per-pair tensors (one layer, tracker off, or no tensor store)"
    L = next(iter(chosen.values()))[1].shape[1]
    if L < 2:
        return None, [], "one layer: no earlier → later head pairs"
    cut: dict[tuple[int, int], list[str]] = {}  # (kept, measured) -> the tensors cut so
    out = {}
    per_tensor = budget // len(chosen)
    for name, (steps, values) in chosen.items():
        keep, note = within(steps, values[0].nbytes, per_tensor, name)
        out[name] = {"steps": steps[keep].astype(int).tolist(), "values": packed(values[keep])}
        if note:
            cut.setdefault((len(keep), len(steps)), []).append(name)
    notes = [
        f"pairs: {', '.join(names)}: {kept} of the {total} measured steps, spread evenly (the page's size budget)"
        for (kept, total), names in cut.items()
    ]
    measures = sorted({n.split("/")[2] for n in out if n.startswith("comp/")})
    baselines = {  # each measure's random baseline [steps, (mean, sd)] (metrics/composition/baseline.py)
        m: {
            "steps": store[f"comp/baseline/{m}"][0].astype(int).tolist(),
            "mean_sd": [plain(row) for row in store[f"comp/baseline/{m}"][1]],
        }
        for m in measures
        if f"comp/baseline/{m}" in store and store[f"comp/baseline/{m}"][1].ndim == 2
    }
    return (
        {
            "tensors": out,
            "measures": measures,
            "kinds": list(KINDS),
            "extra": [n for n in PAIR_TENSORS if n in out],
            "baselines": baselines,
        },
        notes,
        None,
    )


def analysis_curves(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The LLC of every stage analysis of the run (``analysis/NAME/llc.csv``: the model's, each layer's
    and each head's weight-refined λ̂) as curves, and the stage
    boundaries each kept (its ``analysis.json``): ``([{"name", "key", "x", "y"}], [{"step", "label"}])``."""
    curves, boundaries = [], []
    for directory in sorted((run_dir / ANALYSIS_DIR).glob("*/")):
        table = directory / LLC_TABLE
        if table.is_file() and table.stat().st_size:
            for key, (x, y) in read_series(table).items():
                if LLC_CURVE.fullmatch(key):
                    curves.append(
                        {"name": f"{directory.name}: {key}", "key": key, "x": x.astype(int).tolist(), "y": plain(y)}
                    )
        record = directory / ANALYSIS_RECORD
        if record.is_file():
            try:
                result = json.loads(record.read_text()).get("result", {})
            except json.JSONDecodeError:
                continue
            for boundary in result.get("boundaries", []) if isinstance(result, dict) else []:
                boundaries.append(
                    {"step": boundary["step"], "label": f"{directory.name}: {boundary['source']} {boundary['kind']}"}
                )
    return curves, boundaries


def slider_steps(series: dict, store: dict, patterns: Patterns | None) -> list[int]:
    """The steps the slider stops at: the tracker's snapshots (the CSV's ``loss/repeated`` steps), else
    every step any curve or stored tensor has, else the patterns'."""
    if "loss/repeated" in series:
        return series["loss/repeated"][0].astype(int).tolist()
    found = {int(s) for x, _ in series.values() for s in x} | {int(s) for steps, _ in store.values() for s in steps}
    if not found and patterns is not None:
        found = set(patterns.steps)
    return sorted(found)


def run_page(run_dir: Path, patterns: Patterns | None, why_no_patterns: str | None, reader: str = "induction") -> dict:
    """The run page's data, from what ``run_dir`` holds: its CSV log, tensor store, analyses and
    interventions, and ``patterns`` (None: ``why_no_patterns`` is shown in their place)."""
    run_dir = Path(run_dir)
    csv_path = run_dir / CSV_RELATIVE_PATH
    missing: dict[str, str] = {}
    try:
        series = read_series(csv_path) if csv_path.is_file() and csv_path.stat().st_size else {}
    except DamagedFile as error:
        series, missing["curves"] = {}, str(error)
    if not series:
        missing.setdefault(
            "curves", f"no {CSV_RELATIVE_PATH}: the run logged no numbers (CSV logging off, or it never started)"
        )
    store_dir = run_dir / TENSORS_DIR
    try:
        store = read_tensor_store(store_dir) if store_dir.is_dir() else {}
    except DamagedFile as error:
        store = {}
        missing["heads"] = missing["pairs"] = f"no tensor store: {error}"
    measure = plotted_measure(series)
    summary = run_summary(run_dir)
    phase_change = found_phase_change(summary)
    panels = curve_panels(series, measure, phase_change.get("midpoint"))
    wanted = {k for panel in panels for k in panel["keys"]} | {r["key"] for r in readouts(series, measure)}
    notes = list(patterns.notes) if patterns is not None else []
    heads, head_notes, why = head_maps(store, store_dir, reader, HEAD_BUDGET)
    if why:
        missing.setdefault("heads", why)
    pairs, pair_notes, why = pair_maps(store, PAIR_BUDGET)
    if why:
        missing.setdefault("pairs", why)
    if patterns is None:
        missing["patterns"] = why_no_patterns or "no attention patterns"
    llc_curves, boundaries = analysis_curves(run_dir)
    strategies = closest_strategies(series)
    if not any(p["id"].startswith("strategies") for p in panels):
        missing["strategies"] = "the run tracked no strategies"
    if not llc_curves and not any(p["id"] == "llc" for p in panels):
        missing["llc"] = (
            "no LLC: none at training time (stages.llc.every_n_steps=0) and no stage analysis (python -m analysis.stages RUN_DIR)"
        )
    return {
        "kind": "run",
        "title": run_label(run_dir),
        "steps": slider_steps(series, store, patterns),
        "series": {k: {"x": series[k][0].astype(int).tolist(), "y": plain(series[k][1])} for k in sorted(wanted)},
        "top_heads": {k: top_heads(series, k) for k in sorted(wanted) if k.startswith("heads/") and k.endswith("/top")},
        "panels": panels,
        "readouts": readouts(series, measure),
        "measure": measure,
        "closest": strategies,
        "stages": strategy_stages(summary),
        "identity": run_identity(run_dir),
        "happened": happened_line(summary, series),
        "heads": heads,
        "pairs": pairs,
        "patterns": patterns.page() if patterns is not None else None,
        "llc": llc_curves,
        "boundaries": boundaries,
        "interventions": [{"from": a, "until": b, "label": label} for a, b, label in intervention_windows(run_dir)],
        "phase_change": phase_change,
        "notes": notes + head_notes + pair_notes,
        "missing": missing,
    }


def emergence_section(record: dict, event: str = "midpoint", unit: str = "steps") -> dict:
    """The sweep page's emergence section from the sweep's ``emergence.json`` (reports/emergence.py):
    ``rows`` (every law's exponents with their 90 % intervals, whether each bends, which published
    predictions the 95 % interval rejects) and ``charts``, one per variable: ``event``'s ``unit`` against
    it, one line per stratum and value of the other variables (:func:`conditioned_lines`)."""
    rows, charts = [], {}
    predictions = record.get("predictions", [])
    for law in record.get("laws", []):
        stratum = ", ".join(f"{k}={v}" for k, v in law.get("stratum", {}).items())
        for variable, exponent in law.get("exponents", {}).items():
            said = [
                f"{p['who']} {p['exponents'][variable]:+g}: "
                + (
                    "rejected"
                    if not exponent["low95"] <= p["exponents"][variable] <= exponent["high95"]
                    else "consistent"
                )
                for p in predictions
                if p["unit"] == law["unit"] and variable in p["exponents"]
            ]
            bend = law.get("bend", {}).get(variable)
            rows.append(
                {
                    "event": law["event"],
                    "unit": law["unit"],
                    "stratum": stratum,
                    "variable": variable,
                    "exponent": exponent["estimate"],
                    "low90": exponent["low90"],
                    "high90": exponent["high90"],
                    "bends": bool(bend and not bend["low95"] <= 0 <= bend["high95"]),
                    "predictions": "; ".join(said),
                }
            )
            if law["event"] == event and law["unit"] == unit:
                charts.setdefault(variable, []).extend(conditioned_lines(law, variable, stratum))
    return {"event": event, "unit": unit, "rows": rows, "charts": charts}


def conditioned_lines(law: dict, variable: str, stratum: str) -> list[dict]:
    """One line per combination of the law's other variables: its jobs' steps against ``variable``
    (``censored`` marks those at ``max_steps``) and the law there (``fit``), never pooled over the others."""
    others = [k for k in law["exponents"] if k != variable]
    groups: dict[tuple, list[dict]] = {}
    for job in law.get("jobs", []):
        groups.setdefault(tuple(job["values"][k] for k in others), []).append(job)
    lines = []
    for values, jobs in sorted(groups.items()):
        xs = [j["values"][variable] for j in jobs]
        span = [min(xs), max(xs)]
        fixed = law["intercept"] + sum(law["exponents"][k]["estimate"] * math.log(v) for k, v in zip(others, values))
        name = ", ".join([stratum] * bool(stratum) + [f"{k}={v:g}" for k, v in zip(others, values)])
        lines.append(
            {
                "stratum": name,
                "x": xs,
                "y": [j["step"] for j in jobs],
                "censored": [bool(j["censored"]) for j in jobs],
                "fit": {
                    "x": span,
                    "y": [math.exp(fixed + law["exponents"][variable]["estimate"] * math.log(x)) for x in span],
                },
            }
        )
    return lines


def sweep_page(members: list[dict], grouped_by: list[str], title: str, emergence: dict | None = None) -> dict:
    """A sweep page's data: each member ``{"name", "href", "group", "status", "series": {key: (steps,
    values)}}`` (and, where known, its ``seed`` and ``phase_change``: onset, midpoint, end) overlaid,
    coloured by its group (the sweep report's: the non-seed swept values); and the sweep's emergence law
    (:func:`emergence_section`), where it has one."""
    keys = ("loss/repeated", "train/loss", "heads/induction/top", "heads/prev_token/top")
    shown = [k for k in keys if any(k in m["series"] for m in members)]
    steps = sorted({int(s) for m in members for k in shown if k in m["series"] for s in m["series"][k][0]})
    return {
        "kind": "sweep",
        "title": title,
        "emergence": emergence,
        "steps": steps,
        "grouped_by": grouped_by,
        "keys": shown,
        "members": [
            {
                "name": m["name"],
                "href": m["href"],
                "group": m["group"],
                "status": m["status"],
                "seed": m.get("seed", ""),
                "phase_change": m.get("phase_change", []),
                "series": {
                    k: {"x": m["series"][k][0].astype(int).tolist(), "y": plain(m["series"][k][1])}
                    for k in shown
                    if k in m["series"]
                },
            }
            for m in members
        ],
        "notes": [],
        "missing": {} if members else {"members": "no member runs"},
    }


PLOTLY_TARBALL = ASSETS / "plotly.js-cartesian-dist-min-4.1.1.tgz"  # npm's tarball as published, licence inside
PLOTLY_INTEGRITY = (  # npm's dist.integrity of that version: npm view plotly.js-cartesian-dist-min@4.1.1 dist.integrity
    "sha512-o8GrFeusncwBIxbBynRJpY4pkgVB6caM+JLpwrLYbbsO7dZ8FJ+SVN2Fr+L7kiG/Z6w4P5O0Jus/Qr5EefHVeg=="
)
PLOTLY_SCRIPT = "package/plotly-cartesian.min.js"  # the bundle inside the tarball


def tarball_integrity(path: Path) -> str:
    """npm's integrity string of a file: ``sha512-`` and the base64 of its SHA-512."""
    return "sha512-" + base64.b64encode(hashlib.sha512(Path(path).read_bytes()).digest()).decode()


@functools.cache
def plotly_bundle() -> bytes:
    """Plotly's cartesian partial bundle (scatter, heatmap and the rest of the 2-D traces; 1.5 MB, the full
    bundle is 4.8 MB), read from the vendored npm tarball after checking it is the one npm publishes."""
    if not PLOTLY_TARBALL.is_file():
        raise ExplorerError(f"{PLOTLY_TARBALL}: missing (the explorer page's charting bundle; reinstall the project)")
    if tarball_integrity(PLOTLY_TARBALL) != PLOTLY_INTEGRITY:
        raise ExplorerError(f"{PLOTLY_TARBALL}: not the tarball npm publishes for this version (integrity differs)")
    with tarfile.open(PLOTLY_TARBALL, "r:gz") as tar:
        return tar.extractfile(PLOTLY_SCRIPT).read()


@functools.cache
def packed_plotly() -> str:
    """:func:`plotly_bundle` as the page carries it (:func:`gzipped`), made once a process."""
    return gzipped(plotly_bundle())


def gzipped(payload: bytes) -> str:
    """gzip, then base64: what the page's script unpacks with the browser's own ``DecompressionStream``.
    The page carries its bundle and data this way (a third of their size); ``mtime=0`` keeps the bytes
    the same for the same input."""
    return base64.b64encode(gzip.compress(payload, compresslevel=6, mtime=0)).decode("ascii")


def gunzipped(text: str) -> bytes:
    """The inverse of :func:`gzipped`."""
    return gzip.decompress(base64.b64decode(text))


def page_data(html: str) -> dict:
    """The data a page embeds (what :func:`page_html` was given, as JSON read back)."""
    found = re.search(r'<script id="explorer-data"[^>]*>([^<]*)</script>', html)
    if found is None:
        raise ExplorerError("not an explorer page: no embedded data")
    return json.loads(gunzipped(found.group(1)))


def page_html(data: dict) -> str:
    """The whole page: the template with its style and script inlined, Plotly and the data packed."""
    embedded = json.dumps(data, separators=(",", ":"), allow_nan=False)
    parts = {
        "/*STYLE*/": (ASSETS / "explorer.css").read_text(encoding="utf-8"),
        "/*PLOTLY*/": packed_plotly(),
        "/*DATA*/": gzipped(embedded.encode("utf-8")),
        "/*SCRIPT*/": (ASSETS / "explorer.js").read_text(encoding="utf-8"),
        "<!--TITLE-->": f"{data['title']} · explorer".replace("<", "&lt;"),
    }
    html = (ASSETS / "page.html").read_text(encoding="utf-8")
    for marker, text in parts.items():
        if "</script" in text.lower():
            raise ExplorerError(f"{marker}: would close the page's script early")
        html = html.replace(marker, text, 1)
    return html


def write_page(path: Path, data: dict) -> int:
    """Write the page to ``path`` whole or not at all (a temporary file renamed over it); its bytes."""
    html = page_html(data)
    path = Path(path)
    temporary = path.with_name(f".{path.name}.writing")
    temporary.write_text(html, encoding="utf-8")
    os.replace(temporary, path)
    return len(html.encode("utf-8"))


def default_page(directory: Path) -> Path:
    return Path(directory) / EXPLORER_PAGE
