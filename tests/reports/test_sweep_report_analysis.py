"""The sweep report's analysis columns: stage boundaries as columns, read from an analysis's record
of this version and from the stages.json of the version before the analysis protocol."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from metrics.dynamics.stages import Boundary, boundary_columns
from reports.sweep_report import read_analysis

FOUND = [
    Boundary(141.0, "llc", "rise starts", 138.0, 143.0, 0.96, 179.0, "max |slope|/SE"),
    Boundary(365.0, "essential dynamics", "shift", 360.0, 390.0, 0.95, 0.09, "share"),
    Boundary(441.0, "llc", "peak", 440.0, 443.0, 1.0, 22.4, "max |slope|/SE"),
]


def test_boundaries_come_with_their_intervals_and_the_first_two_per_signal_as_numbers():
    columns = boundary_columns([asdict(b) for b in FOUND])
    assert columns["stage_boundaries"] == (
        "141 (138-143, in 96 % of resamples): llc rise starts; 365 (360-390, in 95 % of resamples):"
        " essential dynamics shift; 441 (440-443, in 100 % of resamples): llc peak"
    )
    assert (columns["llc_boundary_1"], columns["llc_boundary_2"]) == (141.0, 441.0)
    assert columns["ed_boundary_1"] == 365.0 and math.isnan(columns["ed_boundary_2"])


def test_an_analysis_record_gives_its_own_columns(tmp_path):
    record = {"analysis": "stages", "columns_title": "stage boundaries", "columns": {"llc_boundary_1": 141.0}}
    (tmp_path / "analysis.json").write_text(json.dumps(record))
    assert read_analysis(tmp_path) == record
    assert read_analysis(tmp_path / "missing") == {}


def test_an_analysis_written_by_the_version_before_is_listed_without_intervals(tmp_path):
    (tmp_path / "stages.json").write_text(
        json.dumps({"boundaries": [{"step": 360.0, "source": "PC3", "kind": "peak"}]})
    )
    columns = read_analysis(tmp_path)["columns"]
    assert columns["stage_boundaries"] == "360: PC3 peak (no interval)"
    assert all(math.isnan(columns[k]) for k in ("llc_boundary_1", "ed_boundary_1"))
