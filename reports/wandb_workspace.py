"""The project's saved W&B workspace: the phase change first, then composition, ground truth, every
pair and the sweep, for a project a user has synced runs to (``wandb sync RUN_DIR/wandb/offline-run-*``):

    python -m reports.wandb_workspace --entity ENTITY --project induction-composition
    python -m reports.wandb_workspace --entity E --project P --group-by model.n_heads --dry-run

It needs the ``dashboard`` extra (``pip install -e '.[dashboard]'``: ``wandb-workspaces``) and an API
key for the server it writes to; ``--dry-run`` prints the workspace it would save and reaches nothing.
The panels are plain data here (:data:`SECTIONS`), named by their W&B keys
(:mod:`records.wandb_sections`, :mod:`reports.wandb_charts`' charts), so a test can check each
against a real run's history before a server ever sees it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from metrics.composition.measures import WEIGHT_MEASURES
from metrics.heads.circuit_scores import MATCHING
from metrics.tracked.base import registered_measures
from records.wandb_run import PAGE_KEY
from records.wandb_sections import wandb_key

SCORERS = (*registered_measures(), MATCHING)


@dataclass(frozen=True)
class Panel:
    """One panel: ``kind`` "line" (``keys`` and/or every key matching ``regex``, against the step),
    "chart" (a ``wandb.plot.line_series`` table named ``keys[0]``), "media" (image keys) or
    "scatter" (summary ``keys[0]`` against each swept config key)."""

    kind: str
    title: str
    keys: tuple[str, ...] = ()
    regex: str | None = None


@dataclass(frozen=True)
class Section:
    name: str
    panels: tuple[Panel, ...]
    is_open: bool = True
    by_swept_keys: bool = False  # its line panels are grouped by the swept config keys


def tracker(*keys: str) -> tuple[str, ...]:
    return tuple(wandb_key(key) for key in keys)


SECTIONS = (
    Section(
        "Phase change",
        (
            Panel("media", "the run's explorer page: one step slider moves every view", (PAGE_KEY,)),
            Panel(
                "line", "repeated vs first-occurrence loss (probe)", tracker("loss/repeated", "loss/first_occurrence")
            ),
            Panel(
                "line",
                "top induction and previous-token scores",
                tracker("heads/induction/top", "heads/prev_token/top"),
            ),
            Panel(
                "line",
                "circuit pair's K-composition (Frobenius), raw and minus baseline",
                tracker("circuit/K/frobenius", "circuit/K/frobenius_minus_baseline"),
            ),
            Panel(
                "line",
                "circuit pair's data-aware K share, and what else its reader's keys read on the probe",
                tracker("circuit/K/share", "circuit/share/K/tokens", "circuit/share/K/positions"),
            ),
            Panel("line", "circuit pair's ablation: loss change (nats)", tracker("circuit/ablation/loss_change")),
            Panel(
                "line",
                "forecast of the loss's midpoint step, and its 80 % interval",
                tracker("forecast/midpoint_step", "forecast/low", "forecast/high"),
            ),
            Panel("line", "forecast: p that the phase change comes by max_steps", tracker("forecast/p_before_end")),
            Panel("line", "in-context learning score", tracker("loss/icl_score")),
            Panel("line", "training loss", ("train/loss",)),
            Panel("media", "the run's phase-change figure", ("images/phase_change",)),
        ),
    ),
    Section(
        "Composition",
        (
            Panel("chart", "circuit pair's K-composition by measure (normalised)", ("charts/circuit_K_by_measure",)),
            Panel(
                "line",
                "circuit pair's K-composition minus baseline, every measure",
                tracker(*(f"circuit/K/{m}_minus_baseline" for m in WEIGHT_MEASURES)),
            ),
            Panel(
                "line",
                "circuit pair's rank among all pairs (1 = first), every measure",
                tracker(*(f"circuit/K/{m}_minus_baseline_rank" for m in WEIGHT_MEASURES)),
            ),
            Panel(
                "media",
                "Q | K | V composition heatmaps (step slider)",
                tuple(f"images/composition/{m}" for m in registered_measures()),
            ),
        ),
    ),
    Section(
        "Ground truth",
        (
            Panel("chart", "each measure's Spearman with the ablation", ("charts/validity_spearman_by_measure",)),
            Panel(
                "line",
                "Spearman with the ablation's loss effect over pairs",
                tracker(*(f"validity/loss_change/{s}/spearman" for s in SCORERS)),
            ),
            Panel(
                "line",
                "rank of the pair the ablation hurts most (1 = the measure puts it first)",
                tracker(*(f"validity/loss_change/{s}/rank_of_truth" for s in SCORERS)),
            ),
            Panel("media", "which measure tells the truth", ("images/validity",)),
        ),
    ),
    Section(
        "Per pair",
        (
            Panel("line", "K-composition (Frobenius), every pair or max / mean", regex=r"^5_pairs/comp/K/frobenius/"),
            Panel("line", "ablation loss change, every pair or max / mean", regex=r"^5_pairs/ablation/loss_change/"),
            Panel("line", "QK matching, every pair or max / mean", regex=r"^5_pairs/match/"),
            Panel("line", "induction score, every head", regex=r"^4_heads/heads/induction/"),
        ),
        is_open=False,
    ),
    Section(
        "Sweep",
        (
            Panel("line", "repeated-token loss", tracker("loss/repeated")),
            Panel("line", "top induction score", tracker("heads/induction/top")),
            Panel("scatter", "the cliff's midpoint step", ("phase_change/loss_midpoint_step",)),
        ),
        is_open=False,
        by_swept_keys=True,
    ),
)
"""The workspace, top to bottom."""


def build_workspace(entity: str, project: str, name: str, group_by: list[str]):
    """The ``wandb_workspaces`` Workspace of :data:`SECTIONS`; ``group_by``: config keys the runs
    and the sweep section are grouped by."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    def panels(section: Section) -> list:
        made = []
        for panel in section.panels:
            if panel.kind == "line":
                groupby = wr.Config(group_by[0]) if section.by_swept_keys and group_by else None
                made.append(
                    wr.LinePlot(title=panel.title, y=list(panel.keys), metric_regex=panel.regex, groupby=groupby)
                )
            elif panel.kind == "chart":
                made.append(
                    wr.CustomChart(
                        query={"summaryTable": {"tableKey": f"{panel.keys[0]}_table"}},
                        chart_name="wandb/lineseries/v0",
                        chart_fields={"step": "step", "lineKey": "lineKey", "lineVal": "lineVal"},
                        chart_strings={"title": panel.title, "xname": "step"},
                    )
                )
            elif panel.kind == "media":
                made.append(wr.MediaBrowser(title=panel.title, media_keys=list(panel.keys), gallery_axis="step"))
            elif panel.kind == "scatter":
                made += [
                    wr.ScatterPlot(title=f"{panel.title} vs {key}", x=wr.Config(key), y=wr.SummaryMetric(panel.keys[0]))
                    for key in group_by
                ]
        return made

    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=[ws.Section(name=s.name, panels=panels(s), is_open=s.is_open) for s in SECTIONS],
        runset_settings=ws.RunsetSettings(groupby=[ws.Config(key) for key in group_by]),
    )


def describe(workspace) -> str:
    """What the workspace holds, section by section, one panel a line."""
    lines = [f"workspace {workspace.name!r} for {workspace.entity}/{workspace.project}"]
    for section in workspace.sections:
        lines.append(f"  {section.name} ({'open' if section.is_open else 'closed'}): {len(section.panels)} panels")
        lines += [f"    {panel!r}" for panel in section.panels]  # the library's repr: the fields set
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write the project's W&B workspace (sections: phase change, composition, ground truth, per pair, sweep)."
    )
    parser.add_argument("--entity", required=True, help="the W&B entity (user or team) the runs were synced to")
    parser.add_argument(
        "--project", required=True, help="the W&B project (logger.wandb.project; default induction-composition)"
    )
    parser.add_argument("--name", default="composition story", help="the workspace's name")
    parser.add_argument(
        "--group-by", nargs="*", default=[], metavar="KEY", help="config keys a sweep varied, e.g. model.n_heads seed"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the workspace and save nothing")
    args = parser.parse_args(argv)
    try:
        workspace = build_workspace(args.entity, args.project, args.name, args.group_by)
    except ImportError:
        print("error: the workspace needs wandb-workspaces: pip install -e '.[dashboard]'", file=sys.stderr)
        return 2
    print(describe(workspace))
    if args.dry_run:
        return 0
    workspace.save()
    print(f"saved: {workspace.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
