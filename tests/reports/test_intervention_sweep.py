"""A sweep over interventions as a user spells it (``train.py -m intervention=none,clamp_prev_token,ablate``):
each job names its intervention, the sweep report groups by it with the training-time validity
table and the groups' figure, and a re-scoring of the saved weights measures the model as it trained."""

from __future__ import annotations

import csv
import json

import pytest

from records import wandb_records
from reports.run_report import read_series
from tests.browser import opened, page_checks
from tests.helpers import WITH_WANDB, module, run_tiny_sweep

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sweep") / "sweep"
    return directory, run_tiny_sweep(
        directory, "intervention=none,clamp_prev_token,ablate", "seed=0", "explorer=true", WITH_WANDB
    )


def test_each_job_names_its_intervention_and_measures_it_on_and_off(sweep):
    directory, _ = sweep
    summaries = [json.loads((directory / str(n) / "summary.json").read_text()) for n in range(3)]
    assert [s["intervention"] for s in summaries] == [
        "none",
        "clamp_prev_token[L0H0] steps 0-end",
        "ablate[L0H0,L0H1] zero steps 0-end",
    ]
    clamped = read_series(directory / "1" / "csv" / "metrics.csv")
    assert set(clamped["heads/prev_token/top"][1]) == {1.0}  # L0H0 attends to the previous token exactly
    assert clamped["intervention_off/heads/prev_token/top"][1].max() < 1.0  # its own pattern does not
    assert "intervention_off/loss/repeated" not in read_series(directory / "0" / "csv" / "metrics.csv")
    ablated = read_series(directory / "2" / "csv" / "metrics.csv")
    assert set(ablated["circuit/K/share"][1]) == {0.0}  # the writer's output is zero: it shares nothing
    config = (directory / "2" / ".hydra" / "config.yaml").read_text()
    assert "kind: ablate" in config and "- L0" in config
    (run_file,) = (directory / "1").glob("wandb/offline-run-*/run-*.wandb")
    assert "intervention:clamp_prev_token[L0H0] steps 0-end" in wandb_records.run(run_file)["tags"]
    assert wandb_records.config(run_file)["intervention"]["kind"] == "clamp"
    assert wandb_records.summary(run_file)["intervention"] == summaries[1]["intervention"]


def test_the_sweep_report_groups_by_intervention_with_the_training_time_validity_table(sweep):
    directory, printed = sweep
    with open(directory / "sweep_groups.csv") as handle:
        groups = list(csv.DictReader(handle))
    assert [g["intervention"] for g in groups] == ["none", "clamp_prev_token", "ablate"]
    with open(directory / "sweep_training_validity.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [row["group"] for row in table] == ["none", "clamp_prev_token", "ablate", "agrees with the truth"]
    assert table[2]["share"] == "0/1"  # an ablated writer: the data-aware share reads no circuit
    assert "training-time validity" in printed
    assert not (directory / "sweep_interventions.png").exists()  # a sweep run with figures=false draws none
    drawn = module("reports.sweep_report", directory)  # the command its end names draws them
    assert drawn.returncode == 0 and (directory / "sweep_interventions.png").stat().st_size > 10_000


def test_a_rescoring_measures_the_saved_weights_with_the_interventions_they_trained_with(sweep):
    directory, _ = sweep
    run = directory / "1"
    result = module("analysis.rescore", run, "--name", "again")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "with its interventions on where they were: clamp_prev_token[L0H0] steps 0-end" in result.stdout
    trained, rescored = (read_series(d / "csv" / "metrics.csv") for d in (run, run / "analysis" / "again"))
    for key in ("loss/repeated", "heads/prev_token/top", "intervention_off/loss/repeated"):
        steps = dict(zip(*trained[key]))
        both = [(step, value) for step, value in zip(*rescored[key]) if step in steps]
        assert len(both) >= 3, key  # steps 0, 30, 60 at least
        for step, value in both:
            assert value == pytest.approx(steps[step], rel=1e-5), (key, step)


def test_the_sweeps_page_overlays_its_runs_grouped_and_links_each_runs_page(sweep):
    """The sweep's explorer.html: each job's curves coloured by its intervention, its numbers at the
    slider's step as its CSV has them, and a link to its own page, which opens with its window shaded."""
    directory, printed = sweep
    page_path = directory / "explorer.html"
    assert f"explorer: {page_path}" in printed
    members = [directory / str(n) for n in range(3)]
    with opened(page_path) as page:
        links = page.page.eval_on_selector_all("table.members a", "links => links.map(a => a.href)")
        assert links == [(m / "explorer.html").resolve().as_uri() for m in members]
        # each row: its swept values, its seed, its status and its phase change (none in these short runs)
        rows = page.page.eval_on_selector_all(
            "table.members tr", "rows => rows.map(r => [...r.children].slice(0, 5).map(c => c.textContent))"
        )
        assert rows[0] == ["run", "group", "seed", "status", "phase change (onset / midpoint / end)"]
        assert [row[1:5] for row in rows[1:]] == [
            [f"intervention={i}", "0", "finished", "none"] for i in ("none", "clamp_prev_token", "ablate")
        ]
        traces = page.chart("chart-loss_repeated")
        assert [t["name"] for t in traces] == [f"intervention={i}" for i in ("none", "clamp_prev_token", "ablate")]
        steps = page.page.evaluate("explorer.steps")
        page.move_slider(len(steps) // 2)
        for row, member in enumerate(members):
            loss = read_series(member / "csv" / "metrics.csv")["loss/repeated"]
            expected = loss[1][list(loss[0]).index(steps[len(steps) // 2])]
            assert float(page.page.eval_on_selector(f"#member-{row}-0", "e => e.dataset.value")) == expected
        page.page.click("table.members a >> nth=1")  # the clamped run's own page
        page.page.wait_for_selector("body[data-ready=true]")
        shapes = page.page.eval_on_selector("#chart-loss", "e => e.layout.shapes.map(s => [s.type, s.x0, s.x1])")
        assert ["rect", 0, 60] in shapes  # clamp_prev_token steps 0-end, shaded
        assert page.errors == [] and all(url.startswith("file://") for url in page.requests), page.requests
    for member in members:  # each run's page at three slider positions, as its CSV has it
        page_checks(member / "explorer.html", member)
    # the command on the sweep's directory (which holds W&B's sweep report run): every run's page, then the sweep's
    result = module("analysis.explorer", directory)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(" wrote ")[1].split(" (")[0] for line in lines] == [
        *(str(m / "explorer.html") for m in members),
        str(page_path),
    ]
    assert lines[-1].endswith("the sweep's 3 runs")
