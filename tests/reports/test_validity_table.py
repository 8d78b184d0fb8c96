"""The validity table: each measure's agreement with the ablation over training, per level, as printed."""

from __future__ import annotations

import math

import numpy as np

from metrics.dynamics.phase_change import PhaseChange
from reports.validity_table import COLUMNS, format_table, validity_rows


def test_validity_table_has_writer_and_reader_columns():
    steps = np.array([0.0, 100.0, 200.0, 300.0])
    series = {
        "validity/loss_change/frobenius/rank_of_truth": (steps, np.array([2.0, 1.0, 2.0, 1.0])),
        "validity/loss_change/frobenius/spearman": (steps, np.array([-0.2, 0.8, 0.8, 1.0])),
        "validity/loss_change/frobenius/writer_rank_of_truth": (steps, np.array([2.0, 1.0, 1.0, 1.0])),
        "validity/loss_change/frobenius/writer_spearman": (steps, np.array([-1.0, 1.0, 1.0, 1.0])),
        "validity/loss_change/frobenius/reader_rank_of_truth": (steps, np.array([1.0, 2.0, 1.0, 2.0])),
        "validity/pattern_change/frobenius/rank_of_truth": (steps, np.array([1.0, 1.0, 1.0, 1.0])),
        "validity/loss_change/match/rank_of_truth": (steps, np.array([1.0, 1.0, 1.0, 1.0])),  # a run before the levels
        "validity/pattern_change/match/rank_of_truth": (steps, np.array([1.0, 1.0, 1.0, 1.0])),
    }
    change = PhaseChange(onset_step=50.0, midpoint_step=100.0, end_step=150.0, start_value=4.0, end_value=0.1)
    frobenius, match = validity_rows(series, change)
    assert list(frobenius) == COLUMNS and COLUMNS[3] == "final_rank_loss"  # pair columns keep their places
    assert frobenius["first_step_ranked_first_loss"] == 300.0  # the pair level loses the truth at 200
    assert frobenius["first_step_ranked_first_writer_loss"] == 100.0  # the writer level does not
    assert frobenius["final_rank_writer_loss"] == 1.0 and frobenius["final_spearman_writer_loss"] == 1.0
    assert frobenius["mean_spearman_after_cliff_writer_loss"] == 1.0  # steps 200, 300
    assert math.isnan(frobenius["first_step_ranked_first_reader_loss"])  # never first for good
    assert frobenius["final_rank_reader_loss"] == 2.0 and math.isnan(frobenius["final_spearman_reader_loss"])
    assert match["first_step_ranked_first_writer_loss"] is None and math.isnan(match["final_rank_writer_loss"])
    table = format_table([frobenius, match])
    pair_header, _, pair_frobenius, _, blank, header, _, frobenius_line, match_line, legend = table.splitlines()
    assert (
        "Spearman (pattern)" in pair_header
        and "(W)" not in pair_header
        and pair_frobenius.split()[1:4] == ["300", "+200", "1"]
    )
    assert (
        blank == "" and header.split()[0] == "measure" and "first for good (W)" in header and "Spearman (R)" in header
    )
    assert frobenius_line.split() == ["frobenius", "100", "1", "+1.00", "+1.00", "never", "2", "-", "-"]
    assert match_line.split() == ["match"] + ["-"] * 8
    assert legend.startswith("(W): writers")
