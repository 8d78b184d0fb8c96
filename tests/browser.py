"""Pages opened in headless Chromium (Debian's ``chromium``, ``make browser``) through
:mod:`bench.explorer_in_browser`'s driver. Where there is no Chromium the tests that need one skip, saying how to
get it; CI sets ``REQUIRE_BROWSER=1`` (``.ci/run``), so there they fail instead."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench import explorer_in_browser
from bench.explorer_in_browser import OpenedPage, readout_mismatches
from records.layout import CSV_RELATIVE_PATH
from reports.run_report import read_series


def chromium() -> str:
    """Chromium's path; skips the test (fails it under ``REQUIRE_BROWSER``) where there is none."""
    path = explorer_in_browser.find_chromium()
    if path is None:
        if os.environ.get("REQUIRE_BROWSER"):
            pytest.fail("REQUIRE_BROWSER is set but there is no chromium or no playwright (make browser)")
        pytest.skip("no headless browser here: `make browser` installs Debian's chromium (root) and playwright")
    return path


@contextmanager
def opened(path: Path) -> Iterator[OpenedPage]:
    with explorer_in_browser.opened(path, chromium()) as page:
        yield page


def page_checks(page_path: Path, run_dir: Path) -> None:
    """The acceptance's checks of a run's page: at three slider positions its read-outs equal the run's
    CSV; no console error, no request outside the file."""
    series = read_series(run_dir / CSV_RELATIVE_PATH)
    n = len(series["loss/repeated"][0])
    with opened(page_path) as page:
        for index in (0, n // 2, n - 1):
            assert readout_mismatches(page, series, index) == []
        assert page.errors == [] and page.outside_requests(page_path) == [], (page.errors, page.requests)
