"""explorer.html in a real browser (headless Chromium, :mod:`tests.browser`): the page a run writes at its
end opens with no console error and no request outside the file; moving its slider moves every view to
the numbers the run saved at that step (its CSV, its tensor store, its weights); a run that kept less
still gets a page that says what it cannot draw; a path that is not a run is one line of error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bench.explorer_in_browser import pattern_error, readout_mismatches
from records import wandb_records
from records.layout import CSV_RELATIVE_PATH
from records.tensor_store import read_tensor_store
from records.trajectory import Trajectory
from reports.explorer_page import page_data
from reports.run_report import read_series
from tests.browser import opened
from tests.helpers import REPO, module

pytestmark = pytest.mark.slow


def overlapping(page, first: str, second: str) -> list[str]:
    """The ids of the page's charts in which the first element matching ``first`` overlaps the first
    matching ``second`` (their bounding boxes in the DOM)."""
    return page.page.evaluate(
        """([first, second]) => [...document.querySelectorAll('.js-plotly-plot')].filter(div => {
            const one = div.querySelector(first), other = div.querySelector(second);
            if (!one || !other) return false;
            const a = one.getBoundingClientRect(), b = other.getBoundingClientRect();
            return !(a.right <= b.left || a.left >= b.right || a.bottom <= b.top || a.top >= b.bottom);
        }).map(div => div.id)""",
        [first, second],
    )


def test_the_default_runs_page_moves_every_view_to_what_the_run_saved(shipped_run):
    """python train.py as shipped: the page it wrote at its end, at three slider positions, and its
    attention pattern of L1H0 at the last step against the model's own from the saved weights."""
    assert shipped_run.returncode == 0, shipped_run.stderr[-3000:]
    run_dir = shipped_run.run_dir
    page_path = run_dir / "explorer.html"
    assert f"explorer: {page_path}" in shipped_run.stdout
    assert page_path.stat().st_size <= 2e6  # the budget for the default run (all views kept)
    # in the W&B run as HTML media (offline: its files, which wandb sync uploads), the page as written
    (logged,) = run_dir.glob("wandb/offline-run-*/files/media/html/explorer_*.html")
    assert logged.read_bytes() == page_path.read_bytes()
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert [row["explorer/_type"] for row in wandb_records.history(run_file) if "explorer/_type" in row] == [
        "html-file"
    ]
    series = read_series(run_dir / CSV_RELATIVE_PATH)
    steps = series["loss/repeated"][0].astype(int)
    store = read_tensor_store(
        run_dir / "tensors", ["heads/induction", "heads/prev_token", "heads/behaviour/type", "comp/K/frobenius"]
    )
    trajectory = Trajectory(run_dir)
    with opened(page_path) as page:
        assert page.page.eval_on_selector("#step-label", "e => e.dataset.step") == str(steps[-1])  # opens at the end
        for index in (0, len(steps) // 2, len(steps) - 1):
            assert readout_mismatches(page, series, index, json.loads((run_dir / "summary.json").read_text())) == []
        # the keys move it as well: ← one snapshot back, → forward again
        page.page.keyboard.press("ArrowLeft")
        assert page.page.eval_on_selector("#step-label", "e => e.dataset.step") == str(steps[-2])
        page.page.keyboard.press("ArrowRight")
        # the attention pattern of L1H0 at the last step, from the trajectory's weights on the page's probe sequence
        assert pattern_error(page, run_dir) <= 1e-6
        assert page.page.eval_on_selector("#patterns-step", "e => e.dataset.step") == str(trajectory.steps[-1])
        # every head's induction score and every pair's K-composition at the last step, from the store
        heads = np.array(page.chart("chart-heads")[0]["z"], dtype=float)
        assert np.allclose(heads, store["heads/induction"][1][-1], atol=1e-6, rtol=0)
        # each head's type at the last step as the tracker stored it, named as summary.json names it, and the
        # previous-token score as stored (both read here without the page's own reader)
        page.page.select_option("#view-heads select", "type")
        (types,) = page.chart("chart-heads")
        assert np.array_equal(np.array(types["z"]), store["heads/behaviour/type"][1][-1])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert types["text"][1][0].startswith(f"L1H0<br>type: {summary['heads/type/L1H0']}<br>")
        page.page.select_option("#view-heads select", "prev_token")
        previous = np.array(page.chart("chart-heads")[0]["z"], dtype=float)
        assert np.allclose(previous, store["heads/prev_token"][1][-1], atol=1e-6, rtol=0)
        pairs = np.array(page.chart("chart-pairs")[0]["z"], dtype=float)  # readers L1H0, L1H1 x writers L0H0, L0H1
        assert np.allclose(pairs, store["comp/K/frobenius"][1][-1][0, :, 1, :].T, atol=1e-6, rtol=0)
        hover = page.chart("chart-pairs")[0]["text"][0][1]
        assert hover.startswith("L0H1 → L1H0: ") and "ablation Δloss" in hover
        # another measure and V-composition, chosen in the page
        page.page.select_option("#view-pairs select >> nth=0", "sv_bound")
        page.page.select_option("#view-pairs select >> nth=1", "V")
        pairs = np.array(page.chart("chart-pairs")[0]["z"], dtype=float)
        stored = read_tensor_store(run_dir / "tensors", ["comp/V/sv_bound"])["comp/V/sv_bound"]
        assert stored[0][-1] == steps[-1] and np.allclose(pairs, stored[1][-1][0, :, 1, :].T, atol=1e-6, rtol=0)
        # the forecast made at each step, as logged, beside the midpoint the run report found
        *forecast, found = page.chart("chart-forecast")
        assert [t["name"] for t in forecast] == ["forecast/midpoint_step", "forecast/low", "forecast/high"]
        logged_steps, logged = series["forecast/midpoint_step"]
        assert forecast[0]["x"] == logged_steps.astype(int).tolist() and np.allclose(
            forecast[0]["y"], logged, atol=1e-4
        )
        assert found["y"] == [summary["phase_change/loss_midpoint_step"]] * 2
        # no legend box over a plot area, nor the toolbar over a legend's first entry (boxes from the DOM)
        assert overlapping(page, "g.legend", ".nsewdrag") == []
        assert overlapping(page, "g.legend g.traces", ".modebar") == []
        # one curve per head score, its hover naming the head on top at each step (from the CSV's per-head columns)
        scores = [t for t in page.chart("chart-scores") if t["name"].startswith("heads/")]
        assert len({t["name"] for t in scores}) == len(scores) and all(t["name"].endswith("/top") for t in scores)
        induction = next(t for t in scores if t["name"] == "heads/induction/top")
        last = np.array([series[f"heads/induction/L{l}H{h}"][1][-1] for l in (0, 1) for h in (0, 1)])
        assert induction["customdata"][-1] == "L{}H{}".format(*divmod(int(np.argmax(last)), 2))
        # the pair heatmap on one scale for the run, from 0, with the measure's random baseline marked on it
        page.page.select_option("#view-pairs select >> nth=0", "frobenius")
        page.page.select_option("#view-pairs select >> nth=1", "K")
        (heatmap,) = page.chart("chart-pairs")
        baseline = read_tensor_store(run_dir / "tensors", ["comp/baseline/frobenius"])["comp/baseline/frobenius"]
        assert heatmap["zmin"] == 0 and heatmap["zmax"] >= np.nanmax(store["comp/K/frobenius"][1]) - 1e-6
        assert heatmap["colorbar"]["ticktext"][1] == f"random {baseline[1][-1][0]:.4g}"
        # at the top, what the run is and what happened in it
        assert page.page.inner_text("#identity").startswith("python train.py ")
        happened = page.page.inner_text("#happened")
        steps = [summary[f"phase_change/loss_{p}_step"] for p in ("onset", "midpoint", "end")]
        assert happened.startswith("phase change {:.0f} / {:.0f} / {:.0f}".format(*steps)), happened
        writer, reader = (
            "L{}H{}".format(*(int(series[f"circuit/{side}_{k}"][1][-1]) for k in ("layer", "head")))
            for side in ("writer", "reader")
        )
        assert f"circuit pair {writer} → {reader}" in happened and f"{reader} induction at" in happened
        # the phase change shaded on every time axis, onset to end
        for chart in ("chart-loss", "chart-scores", "chart-forecast"):
            shapes = page.page.eval_on_selector(f"#{chart}", "e => e.layout.shapes.map(s => [s.type, s.x0, s.x1])")
            assert ["rect", summary["phase_change/loss_onset_step"], summary["phase_change/loss_end_step"]] in shapes
        # play runs the slider from the start, pause stops it
        page.page.click("#play")
        page.page.wait_for_function(f"document.getElementById('step-label').dataset.step !== '{steps[-1]}'")
        page.page.click("#play")
        stopped = page.page.eval_on_selector("#slider", "s => s.value")
        page.page.wait_for_timeout(400)
        assert page.page.eval_on_selector("#slider", "s => s.value") == stopped
        assert page.errors == [] and page.requests == [page_path.resolve().as_uri()], (page.errors, page.requests)


def test_a_run_that_kept_less_still_gets_a_page_that_says_why(tiny_run, tmp_path):
    """The tiny run (explorer=false: it wrote no page) copied without its weights and its tensor store,
    with a stage analysis's LLC table and one boundary written by hand: the command writes a page whose
    pattern, head and pair views say why they are empty, and which draws that LLC and boundary."""
    assert not (tiny_run.run_dir / "explorer.html").exists()  # explorer=false
    bare = tmp_path / "bare"
    shutil.copytree(tiny_run.run_dir, bare, ignore=shutil.ignore_patterns("trajectory", "tensors", "analysis"))
    stages = bare / "analysis" / "stages"
    stages.mkdir(parents=True)
    (stages / "llc.csv").write_text("step,llc_mean,llc_std\n0,1.5,0.1\n30,4.25,0.2\n60,3.0,0.2\n")
    boundary = {"step": 30.0, "source": "llc", "kind": "peak"}
    (stages / "analysis.json").write_text(json.dumps({"result": {"boundaries": [boundary]}}))
    result = module("analysis.explorer", bare)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"explorer: wrote {bare / 'explorer.html'}")
    with opened(bare / "explorer.html") as page:
        assert "kept no weights" in page.why("patterns")
        assert "no per-head scores" in page.why("heads") and "no per-pair tensors" in page.why("pairs")
        assert float(page.readout("loss")["value"]) == read_series(bare / CSV_RELATIVE_PATH)["loss/repeated"][1][-1]
        (llc,) = page.chart("chart-llc")
        assert (llc["name"], llc["x"], llc["y"]) == ("stages: llc_mean", [0, 30, 60], [1.5, 4.25, 3.0])
        shapes = page.page.eval_on_selector("#chart-llc", "e => e.layout.shapes.map(s => [s.x0, s.line.dash])")
        assert [30, "dash"] in shapes  # the boundary, beside the slider's marker
        assert page.errors == []


@pytest.mark.parametrize("make", ["missing", "empty", "file"])
def test_a_path_that_is_not_a_run_is_one_line_of_error(tmp_path, make):
    path = tmp_path / "nothing"
    if make == "empty":
        path.mkdir()
    elif make == "file":
        path.write_text("not a run")
    result = module("analysis.explorer", path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: {path} is not a train.py run directory nor a sweep of them (no .hydra/, csv/, tensors/,"
        " trajectory/ or numbered job directories)"
    )
    assert not (tmp_path / "explorer.html").exists() and (make != "empty" or not any(path.iterdir()))


@pytest.mark.parametrize("command", ["analysis.explorer", "reports.pair_curves"])
def test_an_out_onto_a_file_the_command_did_not_write_is_refused_and_left_as_it_was(
    tiny_run, tmp_path, capsys, command
):
    """``--out RUN/summary.json`` (a mistyped path): one line, exit 2, the file byte for byte as it was;
    a page or figure the command wrote may be written again."""
    import importlib

    main = importlib.import_module(command).main
    summary = tmp_path / "summary.json"
    shutil.copy(tiny_run.run_dir / "summary.json", summary)
    before = summary.read_bytes()
    assert main([str(tiny_run.run_dir), "--out", str(summary)]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"error: --out {summary} exists and this command did not write it: name a new file (nothing written)\n"
    )
    assert summary.read_bytes() == before
    if command == "analysis.explorer":
        page = tmp_path / "page.html"
        assert main([str(tiny_run.run_dir), "--out", str(page)]) == 0
        assert main([str(tiny_run.run_dir), "--out", str(page)]) == 0  # its own page: written again


def test_a_refusal_comes_before_torch_and_the_report_are_imported(tmp_path):
    """The command refuses a path in a fraction of a second: its writers, with torch and the report's
    modules, are imported only once the path holds a run."""
    code = (
        "import sys; from analysis.explorer import main; status = main([sys.argv[1]]);"
        " print(status, [m for m in ('torch', 'matplotlib', 'reports.run_report') if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "nothing")], cwd=REPO, capture_output=True, text=True
    )
    assert result.stdout.split("\n")[-2] == "2 []", result.stdout + result.stderr


def test_a_runs_page_is_written_without_the_plotting_library(tiny_run, tmp_path):
    """The page draws in the browser: writing it reads the run (its CSV, store, head history, weights)
    and imports no matplotlib, which took 0.6 s at the end of every run without the tracker's figures."""
    code = (
        "import sys; from analysis.explorer import main; status = main([sys.argv[1], '--out', sys.argv[2]]);"
        " print(status, 'matplotlib' in sys.modules)"
    )
    page = tmp_path / "page.html"
    result = subprocess.run(
        [sys.executable, "-c", code, str(tiny_run.run_dir), str(page)], cwd=REPO, capture_output=True, text=True
    )
    assert result.stdout.split("\n")[-2] == "0 False", result.stdout + result.stderr
    assert page.stat().st_size > 0


@pytest.mark.parametrize("damaged", ["tensors/index.json", "csv/metrics.csv", ".hydra/config.yaml"])
def test_a_run_with_a_damaged_file_gets_a_page_that_names_it(tiny_run, tmp_path, capsys, damaged):
    """One file cut in half: the page is still written (exit 0), what it could not read is named on it or
    in one line, and the run's files are as they were."""
    from analysis.explorer import main

    run = tmp_path / "run"
    shutil.copytree(tiny_run.run_dir, run, ignore=shutil.ignore_patterns("wandb", "analysis*", "explorer.html"))
    path = run / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main([str(run), "--out", str(tmp_path / "page.html")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 1
    page = json.dumps(page_data((tmp_path / "page.html").read_text()))  # the notes the page shows
    if damaged == "tensors/index.json":
        assert f"no tensor store: {path} is damaged" in page
    else:  # the CSV's cut last row; the config, read only where the run has no trajectory (this one has)
        assert err == "" or err.startswith(str(path))
    assert all(p.read_bytes() == data for p, data in before.items())


def test_the_strategies_panel_names_the_kl_as_the_docs_and_the_tracker_do():
    """The tracker reads KL(strategy ‖ model) (metrics/tracked/strategies.py, docs/configuration.md): the page
    says the same."""
    from reports.explorer_page import curve_panels

    series = {"strategies/kl/uniform": (None, None), "strategies/kl/copy": (None, None)}
    (panel,) = [p for p in curve_panels(series, "frobenius") if p["id"] == "strategies_kl"]
    assert "KL(strategy ‖ model)" in panel["title"]
    assert "KL(strategy ‖ model)" in (REPO / "docs" / "configuration.md").read_text()


def test_the_strategy_in_use_is_read_from_the_switch_record_not_the_flickering_closest():
    """experiment=markov_icl seed 0's per-snapshot closest strategy went uniform → unigram → bigram → unigram
    → bigram ...; its switch record says uniform → unigram → bigram at 580 [520, 740]: the page reads that."""
    from reports.explorer_page import strategy_stages

    summary = {
        "strategies/switches": 2,
        "strategies/switch/1": "uniform → unigram",
        "strategies/switch/1/step": 40.0,
        "strategies/switch/1/low": 40.0,
        "strategies/switch/1/high": 60.0,
        "strategies/switch/2": "unigram → bigram",
        "strategies/switch/2/step": 580.0,
        "strategies/switch/2/low": 520.0,
        "strategies/switch/2/high": 740.0,
    }
    stages = strategy_stages(summary)
    assert stages["first"] == "uniform"
    assert [(w["to"], w["step"], w["low"], w["high"]) for w in stages["switches"]] == [
        ("unigram", 40.0, 40.0, 60.0),
        ("bigram", 580.0, 520.0, 740.0),
    ]
    assert strategy_stages({"strategies/switches": 0}) is None and strategy_stages({}) is None


def test_the_charting_bundle_is_the_one_npm_publishes_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    """The vendored tarball's SHA-512 is npm's published integrity for plotly.js-cartesian-dist-min@4.1.1
    (``npm view plotly.js-cartesian-dist-min@4.1.1 dist.integrity``); a tarball changed by one byte is refused."""
    import tarfile

    from reports import explorer_page

    assert explorer_page.tarball_integrity(explorer_page.PLOTLY_TARBALL) == explorer_page.PLOTLY_INTEGRITY
    assert explorer_page.plotly_bundle().startswith(b"/**\n* plotly.js (cartesian - minified) v4.1.1")
    with tarfile.open(explorer_page.PLOTLY_TARBALL) as tar:
        assert "MIT" in tar.extractfile("package/LICENSE").read().decode()
    changed = tmp_path / explorer_page.PLOTLY_TARBALL.name
    data = bytearray(explorer_page.PLOTLY_TARBALL.read_bytes())
    data[-100] ^= 1
    changed.write_bytes(bytes(data))
    monkeypatch.setattr(explorer_page, "PLOTLY_TARBALL", changed)
    explorer_page.plotly_bundle.cache_clear()
    try:
        with pytest.raises(explorer_page.ExplorerError, match="not the tarball npm publishes"):
            explorer_page.plotly_bundle()
    finally:
        explorer_page.plotly_bundle.cache_clear()


def test_the_page_carries_its_data_packed_and_gives_it_back_whole():
    from reports.explorer_page import page_data, page_html

    data = {"kind": "run", "title": "a <b> & </script>", "steps": [0, 10], "values": [0.1234567891234, None]}
    html = page_html(data)
    assert page_data(html) == data and "</script>" not in html.split("<script", 1)[1].split("</script>", 1)[0]


def test_figure_titles_name_the_run_by_its_overrides(tmp_path):
    from records.layout import figure_title

    run = tmp_path / "sweep" / "3"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- data.batch_size=16\n- seed=2\n- hydra.job.chdir=false\n")
    assert figure_title(run) == "sweep/3 · python train.py data.batch_size=16 seed=2"
    (run / ".hydra" / "overrides.yaml").write_text("[]\n")
    assert figure_title(run) == "sweep/3 · python train.py (as shipped)"
    (run / ".hydra" / "overrides.yaml").write_text("- " + "x" * 200 + "\n")
    assert len(figure_title(run)) == len("sweep/3 · ") + 90
