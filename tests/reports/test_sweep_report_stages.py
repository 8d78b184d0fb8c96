"""The sweep report's stage columns, from stages.json files of this version and of the one before."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from metrics.dynamics.stages import Boundary
from reports.sweep_report import Job, fill_stages


def test_boundaries_come_with_their_intervals_and_the_first_two_per_signal_as_numbers():
    found = [
        Boundary(141.0, "llc", "rise starts", 138.0, 143.0, 0.96, 179.0, "max |slope|/SE"),
        Boundary(365.0, "essential dynamics", "shift", 360.0, 390.0, 0.95, 0.09, "share"),
        Boundary(441.0, "llc", "peak", 440.0, 443.0, 1.0, 22.4, "max |slope|/SE"),
    ]
    job = Job(Path("0"), {}, "finished", "")
    fill_stages(job, {"boundaries": [asdict(b) for b in found]})
    assert job.values["stage_boundaries"] == (
        "141 (138-143, in 96 % of resamples): llc rise starts; 365 (360-390, in 95 % of resamples):"
        " essential dynamics shift; 441 (440-443, in 100 % of resamples): llc peak"
    )
    assert (job.values["llc_boundary_1"], job.values["llc_boundary_2"]) == (141.0, 441.0)
    assert job.values["ed_boundary_1"] == 365.0 and math.isnan(job.values["ed_boundary_2"])


def test_an_analysis_written_by_the_version_before_is_listed_without_intervals():
    job = Job(Path("0"), {}, "finished", "")
    fill_stages(job, {"boundaries": [{"step": 360.0, "source": "PC3", "kind": "peak"}]})
    assert job.values["stage_boundaries"] == "360: PC3 peak (no interval)"
    assert all(math.isnan(job.values[k]) for k in ("llc_boundary_1", "ed_boundary_1"))
