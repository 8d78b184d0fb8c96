"""Real subprocess runs of train.py, checked through the files a user gets: the W&B offline run
file (read back independently), the CSV log, the figure and the summary."""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch

from conf.schema import TrackerConfig
from records import wandb_records
from records.tensor_store import read_tensor_store
from records.wandb_sections import story, tracker_key, wandb_key
from reports.run_report import read_series
from tests import warm_start
from tests.browser import opened, page_checks
from tests.helpers import REPO, WITH_WANDB, module, run_train, train_env

pytestmark = pytest.mark.slow


TRACKED_KEYS = (
    "comp/K/frobenius/L0H1->L1H0",
    "comp/Q/frobenius_minus_baseline/L0H0->L1H1",
    "heads/induction/L1H1",
    "heads/prev_token/top",
    "loss/repeated",
    "circuit/K/frobenius_minus_baseline",
    "comp/baseline/frobenius",
    # every default measure, what the heads write, the ablation and each measure's agreement with it
    "comp/V/sv_bound/L0H0->L1H0",
    "comp/K/whitened/L0H1->L1H1",
    "comp/V/token_space/L0H1->L1H0",
    "comp/Q/whitened_resid/L0H0->L1H1",
    "comp/Q/subspace/L0H1->L1H0",
    "comp/K/component/L0H0->L1H1",
    "comp/K/component_share/L0H0->L1H1",
    "heads/copying/L1H0",
    "heads/ov_copying/L0H1",
    "heads/successor/L1H1",
    "ablation/loss_change/L0H1->L1H0",
    "ablation/pattern_change/L0H0->L1H1",
    "validity/loss_change/sv_bound/rank_of_truth",
    "validity/pattern_change/match/rank_of_truth",
)


DEFAULT_MEASURES = TrackerConfig().measures  # tracker.measures by default, from its one source


def wandb_file(run_dir):
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("short")
    result = run_train(
        [
            "trainer.max_steps=60",
            "tracker.images.every_n_steps=30",
            "tracker.ablation.every_n_steps=10",
            "tracker.writes.every_n_steps=10",
            "logger.wandb.name=short-test",
            "figures=true",  # its figures, files and W&B images are what these tests read
            WITH_WANDB,
        ],
        run_dir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_wandb_run_file_has_tracker_keys_at_expected_steps(short_run):
    run_dir, _ = short_run
    rows = wandb_records.history(wandb_file(run_dir))
    tracked = {}
    for row in rows:
        for key in TRACKED_KEYS:
            if wandb_key(key) in row:
                tracked.setdefault(key, []).append(row["trainer/global_step"])
    assert len(tracked) == len(TRACKED_KEYS)
    for key, steps in tracked.items():
        assert steps == [0, 10, 20, 30, 40, 50, 60], key
    media = wandb_file(run_dir).parent / "files"
    image_rows = [row for row in rows if "images/composition/frobenius/_type" in row]
    assert [row["trainer/global_step"] for row in image_rows] == [0, 30, 60]
    for row in image_rows:  # each row points at PNGs that were really written
        for name in row["images/composition/frobenius/filenames"]:
            assert (media / name).read_bytes()[:4] == b"\x89PNG"
    assert any("train/loss" in row for row in rows)
    figure_rows = [row for row in rows if "images/phase_change/_type" in row]
    assert [row["trainer/global_step"] for row in figure_rows] == [60]
    heatmap_keys = {key.split("/")[2] for row in rows for key in row if key.startswith("images/composition/")}
    assert heatmap_keys == set(DEFAULT_MEASURES)


def test_wandb_tells_the_story_first_and_loses_no_csv_key(short_run):
    """W&B gets every CSV key under its section (records/wandb_sections.py) with the same values; the
    nine story keys sort first (wandb leet's first page), and the summary keeps a loss's minimum
    and a score's maximum besides the last values."""
    run_dir, _ = short_run
    rows = wandb_records.history(wandb_file(run_dir))
    logged: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not key.startswith("_"):
                logged.setdefault(key, {})[row["trainer/global_step"]] = value
    series = read_series(run_dir / "csv" / "metrics.csv")
    tracker_keys = {key for key in series if key not in ("epoch", "train/loss")}
    assert {tracker_key(key) for key in logged} >= tracker_keys  # nothing the CSV has is missing
    for key in tracker_keys:
        steps, values = series[key]
        assert logged[wandb_key(key)] == pytest.approx(dict(zip(steps.tolist(), values.tolist()))), key
    told = sorted(key for key in logged if key.startswith("1_story/"))
    assert sorted(logged)[: len(told)] == told
    for entry in story() - {"heads/statistical_induction/top"}:  # a key, or (ending in "/") a family: every KL
        assert any(tracker_key(k) == entry or (entry.endswith("/") and tracker_key(k).startswith(entry)) for k in told)
    scalars = [
        key for key in logged if not key.startswith(("images/", "validity/table/", "charts/", "explorer/"))
    ]  # not media (the page among them) or tables
    assert len(scalars) == len(tracker_keys) + 3  # the tracker's keys, train/loss, epoch, trainer/global_step
    summary = wandb_records.summary(wandb_file(run_dir))
    repeated = series["loss/repeated"][1]
    assert summary["1_story/loss/repeated"] == pytest.approx({"min": repeated.min(), "last": repeated[-1]})
    induction = series["heads/induction/top"][1]
    assert summary["1_story/heads/induction/top"] == pytest.approx({"max": induction.max(), "last": induction[-1]})
    assert summary["5_pairs/comp/K/frobenius/L0H1->L1H0"] == pytest.approx(series["comp/K/frobenius/L0H1->L1H0"][1][-1])


def test_comparison_charts_in_the_run_file_hold_the_csv_values(short_run):
    """The two custom charts (reports/wandb_charts.py) are in the offline run file as W&B line-series
    panels, and their tables hold the CSV's values at the CSV's steps: the circuit pair's K under
    every measure as (K - b) / (1 - b), and every scorer's Spearman with the ablation."""
    run_dir, _ = short_run
    run_file = wandb_file(run_dir)
    panels = wandb_records.config(run_file)
    series = read_series(run_dir / "csv" / "metrics.csv")
    rows = [row for row in wandb_records.history(run_file) if "charts/circuit_K_by_measure_table/path" in row]
    assert len(rows) == 1 and rows[0]["trainer/global_step"] == 60

    def table(key):
        assert panels[f"_wandb/visualize/{key}"]["panel_config"]["panelDefId"] == "wandb/lineseries/v0"
        logged = json.loads((run_file.parent / "files" / rows[0][f"{key}_table/path"]).read_text())
        assert logged["columns"] == ["step", "lineKey", "lineVal"]
        lines: dict[str, dict[float, float]] = {}
        for step, line, value in logged["data"]:
            lines.setdefault(line, {})[step] = value
        return lines

    composition = table("charts/circuit_K_by_measure")
    measures = DEFAULT_MEASURES
    assert set(measures) <= set(composition)
    for measure in measures:
        steps, values = series[f"circuit/K/{measure}"]
        baseline = series[f"comp/baseline/{measure}"][1][-1] if measure != "share" else 0.0  # the share: no baseline
        expected = {float(s): (v - baseline) / (1 - baseline) for s, v in zip(steps, values)}
        assert composition[measure] == pytest.approx(expected), measure
    steps, loss = series["loss/repeated"]
    assert composition["repeated-token loss / its step-0 value"] == pytest.approx(dict(zip(steps, loss / loss[0])))
    spearman = table("charts/validity_spearman_by_measure")
    assert set(spearman) >= {*measures, "match"}
    for scorer in (*measures, "match"):
        steps, values = series[f"validity/loss_change/{scorer}/spearman"]
        assert spearman[scorer] == pytest.approx(dict(zip(steps, values))), scorer


def test_validity_table_reaches_wandb_csv_and_console(short_run):
    run_dir, result = short_run
    rows = wandb_records.history(wandb_file(run_dir))
    tables = [row for row in rows if row.get("validity/table/_type") == "table-file"]
    assert len(tables) == 1 and tables[0]["trainer/global_step"] == 60
    logged = json.loads((wandb_file(run_dir).parent / "files" / tables[0]["validity/table/path"]).read_text())
    with open(run_dir / "validity.csv", newline="") as handle:
        on_disk = list(csv.DictReader(handle))
    measures = [*DEFAULT_MEASURES, "match"]
    assert [row[0] for row in logged["data"]] == [row["measure"] for row in on_disk] == measures
    assert logged["columns"] == list(on_disk[0])
    series = read_series(run_dir / "csv" / "metrics.csv")
    for logged_row, disk_row in zip(logged["data"], on_disk):  # the final rank is the last logged one
        final_rank = series[f"validity/loss_change/{disk_row['measure']}/rank_of_truth"][1][-1]
        assert logged_row[3] == float(disk_row["final_rank_loss"]) == final_rank
    assert "which measure tells the truth" in result.stdout and "component_share" in result.stdout
    assert (run_dir / "validity.png").read_bytes()[:4] == b"\x89PNG"
    assert any("images/validity/_type" in row for row in rows)


def test_wandb_config_is_the_resolved_hydra_config(short_run):
    run_dir, _ = short_run
    config = wandb_records.config(wandb_file(run_dir))
    assert config["model"]["n_layers"] == 2
    assert config["trainer"]["max_steps"] == 60
    assert config["model"]["normalization"] == "none"


def test_summary_figure_and_csv_are_written(short_run):
    run_dir, result = short_run
    assert (run_dir / "phase_change.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    series = read_series(run_dir / "csv" / "metrics.csv")
    assert summary["final/loss/repeated"] == pytest.approx(series["loss/repeated"][1][-1])
    assert series["loss/repeated"][0].tolist() == [0, 10, 20, 30, 40, 50, 60]
    assert "final/loss/repeated" in result.stdout  # the run prints its summary
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    wandb_summary = wandb_records.summary(wandb_file(run_dir))
    assert wandb_summary["final/loss/repeated"] == pytest.approx(summary["final/loss/repeated"])


def test_figure_command_rerenders_a_finished_run(short_run):
    run_dir, _ = short_run
    (run_dir / "phase_change.png").unlink()
    result = module("reports.run_report", run_dir)  # as `python -m`, in this process
    assert result.returncode == 0, result.stderr
    assert (run_dir / "phase_change.png").is_file()
    missing = module("reports.run_report", run_dir / "nope")
    assert missing.returncode == 2 and "no CSV log" in missing.stderr


def test_a_run_without_figures_has_every_number_and_the_command_draws_them_later(tiny_run, tmp_path):
    """``figures=false`` (the tiny run's, as every test run's: tests.helpers.NO_FIGURES): no PNG, no W&B
    image, the way to draw them said; ``python -m reports.run_report`` then draws all five and writes the
    same summary and validity table, byte for byte."""
    run_dir = tiny_run.run_dir
    assert tiny_run.returncode == 0, tiny_run.stderr[-3000:]
    assert not list(run_dir.glob("*.png"))
    assert f"no figures (figures=false): python -m reports.run_report {run_dir} draws them" in tiny_run.stdout
    assert not any(key.startswith("images/") for row in wandb_records.history(wandb_file(run_dir)) for key in row)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("wandb", "checkpoints", "analysis"))
    result = module("reports.run_report", copy)
    assert result.returncode == 0, result.stderr
    drawn = {"phase_change.png", "composition.png", "strategies.png", "heads.png", "validity.png"}
    assert {path.name for path in copy.glob("*.png")} == drawn
    for name in ("summary.json", "validity.csv"):
        assert (copy / name).read_bytes() == (run_dir / name).read_bytes(), name


def test_pair_curves_command_draws_every_pairs_raw_composition(short_run, tmp_path):
    run_dir, _ = short_run
    result = module("reports.pair_curves", run_dir, "--out", tmp_path / "pairs.png")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pairs.png").is_file() and "L0H1->L1H0" in result.stdout
    from reports.pair_curves import pair_series

    by_measure, pairs = pair_series(run_dir)
    steps, values = by_measure["frobenius"]
    logged_steps, logged = curve(run_dir, "comp/K/frobenius/L0H1->L1H0")  # the CSV's own per-pair key
    assert list(steps) == list(logged_steps)
    np.testing.assert_allclose(values[:, pairs.index((0, 1, 1, 0))], logged, rtol=1e-6)


def curve(run_dir, key):
    steps, values = read_series(run_dir / "csv" / "metrics.csv")[key]
    return steps, values


def test_default_experiment_shows_the_phase_change(shipped_run):
    """`python train.py` as shipped: the acceptance figures of the spine issue."""
    assert shipped_run.returncode == 0, shipped_run.stderr[-3000:]
    tmp_path = shipped_run.run_dir
    summary = json.loads((tmp_path / "summary.json").read_text())
    _, repeated = curve(tmp_path, "loss/repeated")
    _, induction = curve(tmp_path, "heads/induction/top")
    steps, _ = curve(tmp_path, "heads/induction/top")
    assert repeated[0] == pytest.approx(math.log(256), abs=0.2)
    assert repeated[-1] < 0.3
    onset = summary["phase_change/loss_onset_step"]
    assert onset < summary["phase_change/loss_midpoint_step"] < summary["phase_change/loss_end_step"]
    assert induction[steps <= onset].max() < 0.1
    assert induction[-1] > 0.5
    # the pair that K-composes most is a previous-token head feeding an induction head
    series = read_series(tmp_path / "csv" / "metrics.csv")
    pairs = {
        k.rsplit("/", 1)[1]: v[-1] for k, (_, v) in series.items() if k.startswith("comp/K/frobenius_minus_baseline/")
    }
    top_pair = max(pairs, key=pairs.get)
    writer, reader = top_pair.split("->")
    assert series[f"heads/prev_token/{writer}"][1][-1] > 0.4
    assert series[f"heads/induction/{reader}"][1][-1] > 0.5
    assert summary["final/circuit/K/frobenius_minus_baseline"] > 0.05
    assert summary["phase_change/loss_to_value"] < 0.3
    switches = [summary[f"strategies/switch/{i}"] for i in range(1, summary["strategies/switches"] + 1)]
    assert switches[-1].endswith("→ induction"), switches  # the stage truth reaches the induction strategy
    # every head's type: the circuit's writer ends a previous-token head and its reader an induction head,
    # each turning into it within the phase change, with a bootstrap interval around the step
    assert summary[f"heads/type/{writer}"] == "previous_token"
    assert summary[f"heads/type/{reader}"] == "induction"
    for head, kind in ((writer, "previous_token"), (reader, "induction")):
        key = next(
            k for k, v in summary.items() if k.startswith(f"heads/switch/{head}/") and v == f"unspecialised → {kind}"
        )
        assert summary[f"{key}/low"] <= summary[f"{key}/step"] <= summary[f"{key}/high"]
        assert onset - 100 <= summary[f"{key}/step"] <= summary["phase_change/loss_end_step"] + 100
    assert {"previous_token", "induction"} <= set(summary["heads/types"].split(", "))
    assert (tmp_path / "heads.png").is_file()


def test_one_layer_control_shows_no_cliff(tmp_path):
    # 800 steps: twice as long as two layers take to their cliff (steps 333-464 with the default config)
    args = ["experiment=one_layer", "trainer.max_steps=800", "tracker.images.every_n_steps=0", "figures=true"]
    result = run_train(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, repeated = curve(tmp_path, "loss/repeated")
    _, induction = curve(tmp_path, "heads/induction/top")
    assert repeated.min() > 1.5
    assert induction.max() < 0.3  # vs > 0.5 with two layers
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary.get("phase_change/loss_to_value", 99.0) > 1.5  # any detected drop stops far above the cliff
    switches = [v for k, v in summary.items() if k.startswith("strategies/switch/") and isinstance(v, str)]
    assert not any(s.endswith("induction") for s in switches), switches
    assert "phase_change/loss_onset_step" not in summary  # no fall is reported as the induction cliff
    assert "forecast: none (a 1-layer model has no earlier layer for an induction head to read)" in result.stdout
    assert not [k for k in summary if k.startswith("forecast/")]  # its fall by copying is not forecast as the cliff
    assert "no validity table: the model has no earlier->later head pairs" in result.stdout
    assert not (tmp_path / "validity.csv").exists()
    assert (tmp_path / "phase_change.png").is_file()  # a one-layer run's figures: no pairs, no validity table


def test_markov_icl_tracks_its_strategies_against_the_truth(tmp_path):
    """experiment=markov_icl, shortened: the strategies' KLs, lines and weights reach the CSV, W&B's
    story and the tensor store; the run report names the first switch and draws the timeline."""
    args = [
        "experiment=markov_icl",
        "trainer.max_steps=200",
        "tracker.probe_batch_size=16",  # the strategies read 256 chains of their own; this probe's nulls cost a quarter
        "tracker.images.every_n_steps=0",
        "figures=true",
        "explorer=true",
        WITH_WANDB,
    ]
    result = run_train(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    series = read_series(tmp_path / "csv" / "metrics.csv")
    for name in ("uniform", "unigram", "bigram", "truth"):
        assert f"strategies/kl/{name}" in series
    assert series["strategies/line/bigram"][1][-1] == pytest.approx(0.0095, abs=0.004)  # KL(truth ‖ bigram), 256 chains
    assert not [k for k in series if k.startswith("forecast/")]  # its loss falls to the chain's entropy: no forecast
    weights = sum(series[f"strategies/weight/{n}"][1] for n in ("uniform", "unigram", "bigram"))
    assert weights == pytest.approx(np.ones_like(weights))
    logged = {key for row in wandb_records.history(wandb_file(tmp_path)) for key in row}
    assert {
        "1_story/strategies/kl/bigram",
        "1_story/strategies/closest",
        "3_ground_truth/strategies/mixture_kl",
    } <= logged
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategies/switch/1"] == "uniform → unigram"
    assert (
        summary["strategies/switch/1/low"] <= summary["strategies/switch/1/step"] <= summary["strategies/switch/1/high"]
    )
    assert "phase_change/loss_onset_step" not in summary  # chains have no induction strategy to switch to
    assert (tmp_path / "strategies.png").is_file() and "strategy timeline:" in result.stdout
    page_checks(tmp_path / "explorer.html", tmp_path)  # its explorer page: the closest strategy, as the CSV has it
    stored = read_tensor_store(tmp_path / "tensors", ["heads/statistical_induction"])["heads/statistical_induction"]
    with opened(tmp_path / "explorer.html") as page:  # the chains' own reader behaviour, and the types' names
        page.page.select_option("#view-heads select", "statistical_induction")
        shown = np.array(page.chart("chart-heads")[0]["z"], dtype=float)
        assert np.allclose(shown, stored[1][-1], atol=1e-6)
        hover = page.chart("chart-heads")[0]["text"][1][0]
        assert hover.startswith(f"L1H0<br>type: {summary['heads/type/L1H0']}<br>")


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    """Two jobs launched at once (a sweep on a cluster) must not share, and mix, one run directory."""
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "trainer.max_steps=2",
        "tracker.enabled=false",
        "logger=csv",
        "trainer.enable_progress_bar=false",
    ]
    logs = [tmp_path / f"job{i}.log" for i in range(2)]
    with logs[0].open("w") as first, logs[1].open("w") as second:
        jobs = [warm_start.popen(command, tmp_path, train_env(), log, log) for log in (first, second)]  # at once
        codes = [job.wait(timeout=300) for job in jobs]
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    run_dirs = sorted(p.parent for p in tmp_path.glob("outputs/*/*/.hydra"))
    assert len(run_dirs) == 2, run_dirs  # two directories, each with its own resolved config
    assert all((run_dir / ".hydra" / "config.yaml").is_file() for run_dir in run_dirs)


def test_divergence_stops_with_the_step_named_and_keeps_the_finite_checkpoint(tmp_path):
    """optim.lr=1e6: the loss leaves the finite numbers within a few steps; the run must exit
    non-zero naming the step, and no checkpoint of the diverged weights may be written."""
    result = run_train(
        [
            "optim.lr=1e6",
            "optim.warmup_steps=0",
            "trainer.max_steps=200",
            "trainer.checkpoint_every_n_steps=1",
            "tracker.every_n_steps=1",
            "tracker.ablation.every_n_steps=0",
            "tracker.images.every_n_steps=0",
            "logger=csv",
        ],
        tmp_path,
    )
    assert result.returncode != 0
    line = next(line for line in result.stderr.splitlines() if "training diverged at step" in line)
    step = int(line.split("training diverged at step ")[1].split(":")[0])
    assert 0 < step < 200, line
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    if checkpoint.is_file():  # the last one written is from before the divergence, and finite
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        assert state["global_step"] < step
        assert all(torch.isfinite(t).all() for t in state["state_dict"].values())


def test_a_log_that_is_not_a_terminal_gets_progress_lines_not_a_bar(tmp_path):
    result = run_train(
        [
            "trainer.max_steps=20",
            "trainer.enable_progress_bar=true",
            "trainer.progress_every_n_steps=10",
            "tracker.enabled=false",
            "logger=csv",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["10/20", "20/20"], result.stdout[-2000:]
    assert "\r" not in result.stdout + result.stderr  # no carriage-return redraws
