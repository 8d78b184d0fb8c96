"""The explorer pages of finished runs, measured and checked in a real browser: each page's size, the
time to write it against the run's own wall time, and, in headless Chromium (Debian's ``chromium``,
driven by Playwright from the dev extra), no console error, no request outside the file, and at three
slider positions the repeated-token loss, the top induction score, the circuit pair's Frobenius
K-composition and the closest strategy equal to the run's ``metrics.csv`` at that step; the attention
pattern of L1H0 at the last step against the model's own from the trajectory's weights.

    python -m bench.explorer_in_browser RUN_DIR [RUN_DIR ...]      # a sweep directory: its page and its runs'

The page is written again here (``--out`` beside the run's, ``.bench-explorer.html``, removed after),
best of ``--repeat``; the run's own time is from Hydra's start to its ``status.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from analysis.explorer import runs_under
from analysis.explorer_pages import write_run_page, write_sweep_page
from analysis.saved_run import SavedInterventions
from records.layout import CSV_RELATIVE_PATH, EXPLORER_PAGE, HYDRA_CONFIG, HYDRA_DIR, STATUS_FILE
from records.trajectory import Trajectory, TrajectoryError
from reports.explorer_page import run_summary, strategy_stages
from reports.run_report import read_series


def find_chromium() -> str | None:
    """Chromium's path where it and Playwright are installed, else None."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return None
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class OpenedPage:
    """A page as the browser shows it, with what it printed to the console and every URL it asked for."""

    page: object  # playwright.sync_api.Page
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    load_s: float = float("nan")  # from the request to the page's script finished (every view drawn)

    def step(self) -> int:
        return int(self.page.eval_on_selector("#step-label", "e => e.dataset.step"))

    def readout(self, name: str) -> dict[str, str]:
        """A read-out's shown text and its ``data-*`` (``value``, ``step``, ``code``)."""
        return self.page.eval_on_selector(f"#readout-{name}", "e => ({text: e.textContent, ...e.dataset})")

    def why(self, view: str) -> str:
        """What a view that could not be drawn says instead ('' when it is drawn)."""
        return self.page.eval_on_selector(f"#view-{view}", "e => (e.querySelector('.why') || {}).textContent || ''")

    def chart(self, element_id: str) -> list[dict]:
        """The data of the Plotly chart in ``#element_id``, as it is drawn now."""
        return self.page.eval_on_selector(
            f"#{element_id}",
            "e => e.data.map(t => ({z: t.z, x: t.x, y: t.y, text: t.text, name: t.name, customdata: t.customdata,"
            " zmin: t.zmin, zmax: t.zmax, colorbar: t.colorbar}))",
        )

    def move_slider(self, index: int) -> None:
        """Drag the slider to ``index`` (its value set and its ``input`` event sent, as a drag does)."""
        self.page.eval_on_selector(
            "#slider", "(s, i) => { s.value = String(i); s.dispatchEvent(new Event('input', {bubbles: true})); }", index
        )

    def outside_requests(self, path: Path) -> list[str]:
        return [url for url in self.requests if url != Path(path).resolve().as_uri()]


@contextmanager
def opened(path: Path, executable: str, width: int = 1400, height: int = 1000) -> Iterator[OpenedPage]:
    """``path`` loaded from disk in headless Chromium (``executable``), its script finished."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            found = OpenedPage(page)
            page.on("console", lambda m: found.errors.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda error: found.errors.append(str(error)))
            page.on("request", lambda request: found.requests.append(request.url))
            started = time.perf_counter()
            page.goto(Path(path).resolve().as_uri())
            page.wait_for_selector("body[data-ready=true]", timeout=60_000)
            found.load_s = time.perf_counter() - started
            yield found
        finally:
            browser.close()


def value_at(series: dict, key: str, step: int) -> tuple[float, int]:
    """The CSV's value of ``key`` at the last step it was logged at or before ``step``, and that step."""
    steps, values = series[key]
    i = int(np.searchsorted(steps, step, side="right")) - 1
    return float(values[i]), int(steps[i])


READOUTS = (("loss", "loss/repeated"), ("induction", "heads/induction/top"), ("circuit", "circuit/K/frobenius"))


def readout_mismatches(page: OpenedPage, series: dict, index: int, summary: dict | None = None) -> list[str]:
    """At slider position ``index``: each read-out that differs from the run's CSV there, and the strategy in
    use from the run's switch record (``summary``: its ``summary.json``) (none: [])."""
    page.move_slider(index)
    step = int(series["loss/repeated"][0][index])
    wrong = [] if page.step() == step else [f"the slider shows step {page.step()}, not {step}"]
    for name, key in READOUTS:
        if key not in series:
            continue
        shown, (expected, at) = page.readout(name), value_at(series, key, step)
        if not shown.get("value") or float(shown["value"]) != expected or int(shown["step"]) != at:
            wrong.append(
                f"{key} at step {step}: page {shown.get('value')} (step {shown.get('step')}), CSV {expected} (step {at})"
            )
    if summary is not None and (stages := strategy_stages(summary)) is not None:
        shown = page.readout("closest")
        past = [w for w in stages["switches"] if w["step"] <= step]
        expected = past[-1]["to"] if past else stages["first"]
        if shown.get("value") != expected:
            wrong.append(f"strategy at step {step}: page {shown.get('value')}, the switch record {expected}")
    return wrong


def pattern_error(page: OpenedPage, run_dir: Path, head: str = "L1H0") -> float | None:
    """Largest |page − model| of ``head``'s attention pattern at the last saved step, on the page's
    probe sequence, from the trajectory's weights with the run's interventions on where they were, as
    the page draws it (None: no trajectory or no such head on the page)."""
    try:
        trajectory = Trajectory(run_dir)
    except TrajectoryError:
        return None
    if page.page.evaluate(f"!document.getElementById('pattern-{head}')"):
        return None
    page.move_slider(len(page.page.evaluate("explorer.steps")) - 1)
    tokens = page.page.evaluate("explorer.data.patterns.tokens")
    layer, index = int(head[1]), int(head[3:])
    model = trajectory.model(trajectory.steps[-1])
    model.set_changes(SavedInterventions.of(trajectory).changes_at(trajectory.steps[-1]))  # as it trained
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([tokens]), head_out=False)
    expected = cache["pattern"][layer][0, index].double().numpy()
    shown = np.array(page.chart(f"pattern-{head}")[0]["z"], dtype=float)
    below = np.tril_indices(len(tokens))
    if not np.isnan(shown[np.triu_indices(len(tokens), 1)]).all():
        return float("inf")  # attention to later positions: not a causal pattern
    return float(np.abs(shown[below] - expected[below]).max())


def run_wall_seconds(run_dir: Path) -> float | None:
    """The run's time from Hydra's start (its ``.hydra/config.yaml`` written) to its end (``status.json``
    last written); the interpreter's start before Hydra is not in it."""
    started, ended = run_dir / HYDRA_DIR / HYDRA_CONFIG, run_dir / STATUS_FILE
    if not started.is_file() or not ended.is_file():
        return None
    return ended.stat().st_mtime - started.stat().st_mtime


def check_run(run_dir: Path, executable: str | None, repeat: int) -> dict:
    """One run's page: written ``repeat`` times (best), its size, and the browser's checks."""
    out = run_dir / f".bench-{EXPLORER_PAGE}"
    seconds = []
    for _ in range(repeat):
        _, size, spent = write_run_page(run_dir, out)
        seconds.append(spent)
    result = {"run": str(run_dir), "bytes": size, "write_s": min(seconds), "run_s": run_wall_seconds(run_dir)}
    if executable is not None:
        series = read_series(run_dir / CSV_RELATIVE_PATH)
        n = len(series["loss/repeated"][0])
        with opened(out, executable) as page:
            summary = run_summary(run_dir)
            result["mismatches"] = [
                w for index in (0, n // 2, n - 1) for w in readout_mismatches(page, series, index, summary)
            ]
            result["pattern_error"] = pattern_error(page, run_dir)
            result["errors"], result["outside"] = page.errors, page.outside_requests(out)
            result["load_s"] = page.load_s
    out.unlink()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", type=Path, nargs="+", help="run directories or sweep directories")
    parser.add_argument("--repeat", type=int, default=3, help="writes of each page, best taken")
    args = parser.parse_args(argv)
    executable = find_chromium()
    if executable is None:
        print(
            "bench.explorer_in_browser: no chromium or playwright: the browser checks are left out (make browser)",
            file=sys.stderr,
        )
    failed = False
    for path in args.paths:
        runs, sweep = runs_under(path)
        if not runs:
            print(f"error: {path} is not a run directory nor a sweep of them", file=sys.stderr)
            return 2
        for run_dir in runs:
            r = check_run(run_dir, executable, args.repeat)
            share = f", {r['write_s'] / r['run_s']:.1%} of the run's {r['run_s']:.0f} s" if r["run_s"] else ""
            line = f"{run_dir}: {r['bytes'] / 1e6:.2f} MB, written in {r['write_s']:.2f} s{share}"
            if executable is not None:
                ok = not r["mismatches"] and not r["errors"] and not r["outside"]
                pattern = (
                    ""
                    if r["pattern_error"] is None
                    else f"; L1H0 pattern at the last step within {r['pattern_error']:.1e}"
                )
                line += (
                    f"; opens in {r['load_s']:.1f} s; {'3 slider positions equal the CSV' if ok else 'WRONG'}{pattern}"
                )
                for problem in (
                    r["mismatches"] + [f"console: {e}" for e in r["errors"]] + [f"request: {u}" for u in r["outside"]]
                ):
                    line += f"\n  {problem}"
                failed |= not ok or (r["pattern_error"] is not None and r["pattern_error"] > 1e-6)
            print(line, flush=True)
        if sweep:
            started = time.perf_counter()
            page, size, _ = write_sweep_page(path, runs, path / f".bench-{EXPLORER_PAGE}")
            spent = time.perf_counter() - started
            line = f"{path} (sweep of {len(runs)}): {size / 1e6:.2f} MB, written in {spent:.2f} s"
            if executable is not None:
                with opened(page, executable) as opened_page:
                    links = opened_page.page.eval_on_selector_all("table.members a", "links => links.length")
                    clean = not opened_page.errors and not opened_page.outside_requests(page)
                line += f"; browser: {links} links, {'no console error, no outside request' if clean else 'WRONG'}"
                failed |= not clean or links != len(runs)
            page.unlink()
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
