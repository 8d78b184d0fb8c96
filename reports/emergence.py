"""When the phase change comes, across a sweep: its step as a power law of every numeric value the
sweep varied (:mod:`metrics.dynamics.emergence_law`), in steps and in tokens, beside what the
published laws predict, with the jobs whose phase change had not come by ``max_steps`` censored.

    python -m reports.emergence multirun/2026-12-06/10-00-00
    python -m reports.emergence SWEEP_DIR --resamples 2000 --out law/

Reads the sweep's run directories as :mod:`reports.sweep_report` does. The events fitted: the loss's
phase change (its onset and midpoint, ``phase_change/loss_*``) and, on tasks with strategies, the
unigram -> bigram switch (``strategies/switch/*``); each where at least one job has it. A swept value
that is not a number (``data.block_follows_context=false,true``, an intervention's name) is not a
variable of the law: each of its values gets a law of its own. Writes ``emergence.csv`` (a row per
law and variable: the exponent with its 90 % and 95 % intervals, each published prediction and whether
the data reject it at 95 %), ``emergence.json`` (the same, with the local exponents and every job's
point) and ``emergence.png`` (the step against each variable on log axes, a line per value of the
other variable, each cell's mean ± sd over seeds, censored jobs as open triangles at ``max_steps``,
the fit with its 90 % band, and the predicted slopes drawn through the fit's middle); prints the
verdict table. At the end of a multirun, :mod:`runtime.sweep_callback` runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from metrics.dynamics.emergence_law import Law, NoLaw, Observation, fit_emergence_law
from records.layout import EMERGENCE_FIGURE, EMERGENCE_RECORD, EMERGENCE_TABLE
from records.status import FINISHED
from records.tables import write_rows
from reports.sweep_report import SEED_KEYS, Job, format_table, keys_varying_across, read_jobs

EVENTS = {  # the event's name: the sweep table's column of its step
    "midpoint": "phase_change_midpoint",  # the repeated-token loss's largest fall
    "onset": "phase_change_onset",
    "induction midpoint": "induction_midpoint",  # the top induction score's largest rise
    "induction onset": "induction_onset",
    "unigram->bigram": "switch unigram->bigram",
}

PREDICTIONS = {  # (who, unit): {variable: exponent}
    ("Aoyama et al. 2025", "steps"): {"data.batch_size": -0.5, "data.seq_len": -0.5},
    ("Aoyama et al. 2025", "tokens"): {"data.batch_size": 0.5, "data.seq_len": 0.5},
    ("Musat et al. 2025", "steps"): {"data.seq_len": 2.0},
    ("Olsson et al. 2022", "tokens"): {"model.d_model": 0.0, "model.n_heads": 0.0},
}
"""What the published laws say of each exponent: Aoyama, Wilcox & Schneider 2025 (arXiv 2511.16893),
tokens to emergence ∝ √(B·C), so steps ∝ (B·C)^-½; Musat et al. 2025 (arXiv 2511.01033), the
emergence time (in training steps at a fixed batch) ∝ C²; Olsson et al. 2022, a roughly fixed number
of tokens across model sizes."""


@dataclass(frozen=True)
class EmergenceLaw:
    """One fitted law (or why none): the event, the unit, the values of the sweep's non-numeric
    settings it holds for (``stratum``), and its observations."""

    event: str
    unit: str
    stratum: dict[str, str]
    law: Law | NoLaw
    observations: list[Observation]


def numeric(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def numeric_variables(jobs: list[Job]) -> list[str]:
    """The settings the sweep varied (seeds aside) whose every value is a positive number: a law's variables."""
    swept = [k for k in keys_varying_across(jobs) if k not in SEED_KEYS]
    return [k for k in swept if all(numeric(job.overrides.get(k, "")) is not None for job in jobs)]


def job_observation(job: Job, column: str, variables: list[str]) -> Observation | None:
    """The job's event step, or censored at its ``max_steps`` where it has none; None for a job that
    did not finish (it says nothing of when the event would come)."""
    if job.status != FINISHED:
        return None
    trainer, data = job.config.get("trainer", {}), job.config.get("data", {})
    tokens_per_step = float(data.get("batch_size", 1)) * float(data.get("seq_len", 1))
    tokens_per_step *= float(trainer.get("accumulate_grad_batches", 1))
    values = {k: numeric(job.overrides.get(k, "")) for k in variables}
    step = job.values.get(column, math.nan)
    if isinstance(step, (int, float)) and math.isfinite(step):
        return Observation(values, float(step), False, tokens_per_step)
    return Observation(values, float(trainer.get("max_steps", math.nan)), True, tokens_per_step)


def emergence_laws(jobs: list[Job], resamples: int = 1000, seed: int = 0) -> tuple[list[EmergenceLaw], list[str]]:
    """Every law the sweep's ``jobs`` carry (each event, unit and stratum), and the lines that say what
    was left out (jobs not finished, events no job has)."""
    swept = [k for k in keys_varying_across(jobs) if k not in SEED_KEYS]
    variables = numeric_variables(jobs)
    strata_keys = [k for k in swept if k not in variables]
    notes = []
    if unfinished := [job for job in jobs if job.status != FINISHED]:
        notes.append(f"{len(unfinished)} of {len(jobs)} jobs did not finish: left out (they say nothing of when)")
    strata: dict[tuple, list[Job]] = {}
    for job in jobs:
        strata.setdefault(tuple(job.overrides.get(k, "") for k in strata_keys), []).append(job)
    laws = []
    on_chains = any(
        job.config.get("data", {}).get("name") == "markov_icl" or (k.startswith("switch ") and "gram" in k)
        for job in jobs
        for k in [*job.values, ""]
    )
    for event, column in EVENTS.items():
        if column.startswith("switch ") and not on_chains:
            continue  # not in-context chains: no unigram -> bigram switch to time
        for values, members in strata.items():
            observations = [o for job in members if (o := job_observation(job, column, variables)) is not None]
            for unit in ("steps", "tokens"):
                law = (
                    fit_emergence_law(observations, unit, resamples, seed)
                    if variables
                    else NoLaw(
                        f"no numeric value varies across the {len(jobs)} jobs"
                        + (f" ({', '.join(swept)} are not numbers)" if swept else "")
                    )
                )
                laws.append(EmergenceLaw(event, unit, dict(zip(strata_keys, values)), law, observations))
    return laws, notes


def verdict_rows(laws: list[EmergenceLaw]) -> list[dict]:
    """A row per law and variable: the exponent, its intervals, and each prediction with its verdict."""
    rows = []
    for item in laws:
        base = {"event": item.event, "unit": item.unit, **item.stratum}
        if isinstance(item.law, NoLaw):
            rows.append({**base, "variable": "", "why_no_law": item.law.reason})
            continue
        law = item.law
        for variable, exponent in law.exponents.items():
            row = {
                **base,
                "variable": variable,
                "exponent": exponent.estimate,
                "low90": exponent.low90,
                "high90": exponent.high90,
                "low95": exponent.low95,
                "high95": exponent.high95,
                "bends": "yes" if law.bends(variable) else ("no" if variable in law.bend else "-"),
                "jobs": law.jobs,
                "censored": law.censored,
            }
            verdicts = [
                f"{who} {predicted[variable]:+g}: {'rejected' if exponent.rejects(predicted[variable]) else 'consistent'}"
                for (who, unit), predicted in PREDICTIONS.items()
                if unit == item.unit and variable in predicted
            ]
            row["predictions (at 95 %)"] = "; ".join(verdicts) or "-"
            rows.append(row)
    return rows


def write_emergence(
    laws: list[EmergenceLaw], notes: list[str], directory: Path, figure: bool = True
) -> dict[str, Path]:
    """``emergence.csv``, ``emergence.json`` and, with ``figure``, ``emergence.png`` in ``directory``: the
    files written, by name."""
    names = (EMERGENCE_TABLE, EMERGENCE_RECORD, *((EMERGENCE_FIGURE,) if figure else ()))
    files = {name: directory / name for name in names}
    write_rows(files[EMERGENCE_TABLE], verdict_rows(laws))
    record = {
        "notes": notes,
        "predictions": [{"who": who, "unit": unit, "exponents": e} for (who, unit), e in PREDICTIONS.items()],
        "laws": [
            {
                "event": item.event,
                "unit": item.unit,
                "stratum": item.stratum,
                **({"why_no_law": item.law.reason} if isinstance(item.law, NoLaw) else law_record(item.law)),
                "jobs": [asdict(o) for o in item.observations],
            }
            for item in laws
        ],
    }
    temporary = files[EMERGENCE_RECORD].with_suffix(".json.tmp")
    temporary.write_text(json.dumps(record, indent=1, default=float))
    temporary.replace(files[EMERGENCE_RECORD])
    if figure:
        draw_emergence(laws, files[EMERGENCE_FIGURE])
    return files


def law_record(law: Law) -> dict:
    return {
        "exponents": {k: asdict(v) for k, v in law.exponents.items()},
        "intercept": law.intercept,
        "sigma": law.sigma,
        "censored": law.censored,
        "resamples": law.resamples,
        "local_exponents": {
            k: [
                {
                    "between": [e.low_value, e.high_value],
                    "censored": e.censored,
                    **(asdict(e.exponent) if e.exponent is not None else {}),
                }
                for e in local
            ]
            for k, local in law.local.items()
        },
        "bend": {k: asdict(v) for k, v in law.bend.items()},
    }


def draw_emergence(laws: list[EmergenceLaw], path: Path) -> None:
    """A row of panels per event and stratum (in steps), a panel per variable: the step against the
    variable on log axes, one line per value of the other variables (the figure conditions, it never
    pools), each cell's mean ± sd over seeds, censored jobs as open triangles, the fit and its 90 %
    band, and each published slope drawn through the fit's middle."""
    from reports.plots import plt

    drawn = [item for item in laws if item.unit == "steps" and isinstance(item.law, Law)]
    if not drawn:
        fig, ax = plt.subplots(figsize=(6, 2))
        reasons = sorted({item.law.reason for item in laws if isinstance(item.law, NoLaw)})
        ax.text(0.5, 0.5, "no law: " + "; ".join(reasons)[:200], ha="center", va="center", wrap=True, fontsize=8)
        ax.axis("off")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    width = max(len(item.law.exponents) for item in drawn)
    fig, axes = plt.subplots(len(drawn), width, figsize=(5.2 * width + 2.6, 4.2 * len(drawn)), squeeze=False)
    for row, item in zip(axes, drawn):
        law = item.law
        for ax, variable in zip(row, law.exponents):
            draw_variable(ax, item, variable)
        for ax in row[len(law.exponents) :]:
            ax.axis("off")
    fig.suptitle("the phase change's step against each swept value\n(log axes; open triangles: none by max_steps)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.7 / fig.get_figheight()))  # room for the two-line title
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_variable(ax, item: EmergenceLaw, variable: str) -> None:
    from matplotlib.ticker import NullFormatter

    from reports.plots import plt

    law, observations = item.law, item.observations
    others = [k for k in law.exponents if k != variable]
    lines: dict[tuple, list[Observation]] = {}
    for o in observations:
        lines.setdefault(tuple(o.values[k] for k in others), []).append(o)
    colours = plt.get_cmap("viridis")(np.linspace(0.05, 0.85, max(len(lines), 1)))
    xs = np.array(sorted({o.values[variable] for o in observations}))
    for colour, (fixed, members) in zip(colours, sorted(lines.items())):
        label = ", ".join(f"{k.split('.')[-1]}={v:g}" for k, v in zip(others, fixed)) or "all"
        means, sds, at = [], [], []
        for x in xs:
            cell = [o.step for o in members if o.values[variable] == x and not o.censored]
            if cell:
                at.append(x)
                means.append(np.exp(np.mean(np.log(cell))))
                sds.append(np.std(cell, ddof=1) if len(cell) > 1 else 0.0)
        ax.errorbar(at, means, yerr=sds, fmt="o", color=colour, capsize=3, ms=4, label=label)
        censored = [o for o in members if o.censored]
        if censored:
            ax.scatter(
                [o.values[variable] for o in censored],
                [o.step for o in censored],
                marker="^",
                facecolors="none",
                edgecolors=colour,
                s=40,
            )
        grid = np.geomspace(xs[0], xs[-1], 40)
        fit = [law.predict({variable: x, **dict(zip(others, fixed))}) for x in grid]
        ax.plot(grid, fit, color=colour, lw=1.2)
    exponent = law.exponents[variable]
    middle_x = math.sqrt(xs[0] * xs[-1])
    middle_others = {k: math.exp(np.mean([math.log(o.values[k]) for o in observations])) for k in others}
    middle_y = law.predict({variable: middle_x, **middle_others})
    for low, high in ((exponent.low90, exponent.high90),):
        band = [middle_y * (xs[0] / middle_x) ** low, middle_y * (xs[0] / middle_x) ** high]
        band_end = [middle_y * (xs[-1] / middle_x) ** low, middle_y * (xs[-1] / middle_x) ** high]
        ax.fill_between(
            [xs[0], middle_x, xs[-1]],
            [min(band), middle_y, min(band_end)],
            [max(band), middle_y, max(band_end)],
            color="0.6",
            alpha=0.25,
            lw=0,
            label=f"fit {exponent.estimate:+.2f} [{exponent.low90:+.2f}, {exponent.high90:+.2f}] (90 %)",
        )
    styles = iter(["--", ":", "-."])
    for (who, unit), predicted in PREDICTIONS.items():
        if unit == item.unit and variable in predicted:
            slope = predicted[variable]
            ax.plot(
                xs[[0, -1]],
                middle_y * (xs[[0, -1]] / middle_x) ** slope,
                ls=next(styles),
                color="k",
                lw=1,
                label=f"{who.split(' ')[0]}: {slope:+g}" + (" (rejected)" if exponent.rejects(slope) else ""),
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(variable)
    ax.set_ylabel(f"{item.event} step")
    stratum = ", ".join(f"{k}={v}" for k, v in item.stratum.items())
    ax.set_title(
        f"{item.event}" + (f" ({stratum})" if stratum else "") + f": {law.jobs} jobs, {law.censored} censored",
        fontsize=9,
    )
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(alpha=0.3, which="both")


def print_emergence(laws: list[EmergenceLaw], notes: list[str], files: dict[str, Path] | None = None) -> None:
    """The verdict table (exponents with their 90 % intervals and each prediction's verdict at 95 %),
    the local exponents where a law bends, and one line for each law that could not be fitted."""
    print(
        "\nemergence law: the phase change's step ∝ Π value^exponent (log-log, censored jobs kept; 90 % intervals over seeds)"
    )
    for note in notes:
        print(f"  {note}")
    rows = [row for row in verdict_rows(laws) if row.get("variable")]
    if rows:
        shown = []
        for row in rows:
            cells = {k: v for k, v in row.items() if k not in ("low95", "high95", "low90", "high90")}
            cells["exponent"] = f"{row['exponent']:+.3f} [{row['low90']:+.3f}, {row['high90']:+.3f}]"
            shown.append(cells)
        columns = list(dict.fromkeys(k for row in shown for k in row))
        print(format_table(shown, columns))
    refused: dict[tuple[str, str], list[str]] = {}  # (stratum, reason): the events it holds for
    for item in laws:
        if isinstance(item.law, NoLaw):
            stratum = " ".join(f"{k}={v}" for k, v in item.stratum.items())
            refused.setdefault((stratum, item.law.reason), []).append(item.event)
    for (stratum, reason), events in refused.items():
        print(f"  no law{' (' + stratum + ')' if stratum else ''} for {', '.join(dict.fromkeys(events))}: {reason}")
    for item in laws:
        if isinstance(item.law, NoLaw):
            continue
        if item.unit == "steps":
            for variable, local in item.law.local.items():
                parts = [
                    f"{e.low_value:g}-{e.high_value:g}: "
                    + (
                        "censored"
                        if e.exponent is None
                        else f"{e.exponent.estimate:+.2f} [{e.exponent.low90:+.2f}, {e.exponent.high90:+.2f}]"
                    )
                    for e in local
                ]
                bend = "bends" if item.law.bends(variable) else "one law"
                where = ", ".join([item.event, *(f"{k}={v}" for k, v in item.stratum.items()), "steps"])
                print(f"  local exponents of {variable} ({where}): {'; '.join(parts)} -> {bend}")
    if files:
        print(f"  files: {', '.join(str(p) for p in files.values())}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "sweep", type=Path, nargs="+", help="a sweep directory (multirun/DATE/TIME), or run directories"
    )
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the first path)")
    parser.add_argument("--resamples", type=int, default=1000, help="resamples of the seeds within each cell")
    args = parser.parse_args(argv)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        print(f"error: --out {args.out} is a file: name a directory (emergence.* are written into it)", file=sys.stderr)
        return 2
    if args.resamples < 100:
        print(f"error: --resamples {args.resamples}: at least 100 for a 95 % interval", file=sys.stderr)
        return 2
    try:
        jobs = read_jobs(args.sweep)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    laws, notes = emergence_laws(jobs, args.resamples)
    directory = Path(args.out or args.sweep[0])
    directory.mkdir(parents=True, exist_ok=True)
    files = write_emergence(laws, notes, directory)
    print_emergence(laws, notes, files)
    return 0 if any(isinstance(item.law, Law) for item in laws) else 1


if __name__ == "__main__":
    sys.exit(main())
