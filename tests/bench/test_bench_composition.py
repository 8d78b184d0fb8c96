"""The composition benchmark (``python -m bench.composition``) on its small shape: TransformerLens
gets our exact weights, agrees with our Frobenius scores in float64, every measure matches its
dense reference, and every timing and memory figure is a real number."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from bench import composition as bench
from tests.helpers import require_extra


@pytest.mark.slow
def test_small_shape_agrees_with_transformer_lens_and_reports_real_numbers():
    require_extra("transformer_lens", "tl")
    r = bench.measure_shape(bench.SHAPES["small"], repeats=1)

    assert r["weights_equal_float32"] and r["weights_equal_float64"]
    assert r["logit_error_float64"] <= 1e-10
    assert r["logit_error_float32"] <= 1e-4
    assert r["ours_dtype"] == "float32"  # the timed path is the model's dtype
    for kind in bench.KINDS:
        assert r["frobenius_vs_tl"][kind] <= bench.TOLERANCE, kind
    for measure, error in r["dense_spot_check"].items():
        assert error <= bench.TOLERANCE, measure
    assert r["unscored_are_nan"]

    assert not r["failed"]
    seconds = [*r["ours"].values(), *r["tl"].values(), r["speedup_frobenius_K"]]
    assert all(s is not None and math.isfinite(s) and s > 0 for s in seconds), seconds
    for side in ("ours", "tl"):
        extra = r["memory"][side]["bytes"]
        assert extra is not None and 0 <= extra < 2e9, (side, r["memory"])


@pytest.mark.slow
def test_the_agreement_check_tells_q_from_k():
    """The comparison is sharp enough to catch the classic bug, K scored as Q: TL's Q-composition
    is far from our K-composition on the same model."""
    require_extra("transformer_lens", "tl")
    shape = bench.SHAPES["small"]
    model64 = bench.build_model(shape).double()
    ours = bench.ours_composition(model64, ("frobenius",), bench.probe_residual(model64))["frobenius"]
    tl = bench.build_tl_model(model64)
    mask = bench.scored_mask(shape)
    q_reference, _ = bench.tl_reference(tl, shape, "Q")
    assert bench.max_relative_error(ours["Q"][mask], q_reference[mask]) <= bench.TOLERANCE
    assert bench.max_relative_error(ours["K"][mask], q_reference[mask]) > 1e-2


def test_dense_reference_on_a_constructed_pair():
    """A writes along e0 (σ 3) and e2 (σ 1); B reads along e0 (σ 2) and e1 (σ 1): closed-form values."""
    A = torch.diag(torch.tensor([3.0, 0, 1, 0, 0, 0], dtype=torch.float64))
    B = torch.diag(torch.tensor([2.0, 1, 0, 0, 0, 0], dtype=torch.float64))
    values = bench.dense_measures(bench.Dense.of(A), bench.Dense.of(B), d_head=2)
    assert values["frobenius"] == pytest.approx(6 / math.sqrt(10 * 5))  # ‖AB‖ = 6
    assert values["sv_bound"] == pytest.approx(6 / math.sqrt(9 * 4 + 1 * 1))
    assert values["subspace"] == pytest.approx(1 / 2)  # e0 shared, e2 ⟂ span(e0, e1)
    assert values["component"] == pytest.approx(2 / math.sqrt(5))  # the e0 component
    assert values["component_share"] == pytest.approx(1.0)  # the e2 component reads nothing


def test_missing_transformer_lens_exits_2_with_the_install_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformer_lens", None)  # makes `import transformer_lens` fail
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--shapes", "small"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[tl]'" in err and len(err.strip().splitlines()) == 1
