"""docs/measures.md's axioms, asserted: constructed matrices against closed-form values (axioms 1-3),
and invariance under each function-preserving reparametrisation (axiom 4) of a trained model without
normalization and of LayerNorm and RMSNorm models, with random and with unit gains."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from bench.axiom_table import train_small_model
from bench.axioms import PATH_POINTS, axiom_table, constructed_scores
from data.probe import make_probe_batch
from metrics.composition.measures import WEIGHT_MEASURES
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import module, random_model

S_A = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)  # the constructed writer's singular values
S_B = torch.tensor([5.0, 0.5, 0.1], dtype=torch.float64)  # the reader's, same order
THETA = torch.linspace(0, math.pi / 2, PATH_POINTS, dtype=torch.float64)
SCORES = [m for m in WEIGHT_MEASURES if m != "component_share"]  # a share, not a score


@pytest.mark.parametrize("measure", list(WEIGHT_MEASURES))
def test_axiom_1_aligned_rank_one_scores_one(measure):
    assert constructed_scores(WEIGHT_MEASURES[measure]).aligned_rank_one == pytest.approx(1.0, rel=1e-12)


def test_axiom_1_aligned_rank_three_closed_forms():
    """A B = into diag(s_a s_b) outᵀ, so each measure has a closed form on the aligned pair."""
    got = {m: constructed_scores(f).aligned for m, f in WEIGHT_MEASURES.items()}
    assert got["sv_bound"] == pytest.approx(1.0, rel=1e-12)  # its promise: aligned and same order
    assert got["subspace"] == pytest.approx(1.0, rel=1e-12)
    frobenius = ((S_A * S_B).norm() / (S_A.norm() * S_B.norm())).item()
    assert got["frobenius"] == pytest.approx(frobenius, rel=1e-12) and frobenius < 0.8  # never 1 for rank > 1
    assert (
        got["whitened"] == got["whitened_resid"] == got["token_space"] == got["frobenius"]
    )  # Σ = I on constructed matrices
    assert got["component"] == pytest.approx((S_B[0] / S_B.norm()).item(), rel=1e-12)
    energy = (S_A * S_B).square()
    assert got["component_share"] == pytest.approx((energy[0] / energy.sum()).item(), rel=1e-12)


@pytest.mark.parametrize("measure", SCORES)
def test_axiom_2_orthogonal_scores_zero(measure):
    assert abs(constructed_scores(WEIGHT_MEASURES[measure]).orthogonal) < 1e-12


def test_component_share_is_undefined_when_nothing_composes():
    assert math.isnan(constructed_scores(WEIGHT_MEASURES["component_share"]).orthogonal)


@pytest.mark.parametrize("measure", SCORES)
def test_axiom_3_monotone_and_smooth_down_to_zero(measure):
    c = constructed_scores(WEIGHT_MEASURES[measure])
    assert c.monotone and c.smooth
    assert abs(c.rotation_path[-1]) < 1e-12


def test_axiom_3_paths_follow_the_angle():
    """Rotating every write direction by θ scales A B by cos θ and the overlap by cos² θ."""
    frobenius = constructed_scores(WEIGHT_MEASURES["frobenius"]).rotation_path
    torch.testing.assert_close(frobenius, frobenius[0] * THETA.cos(), rtol=1e-9, atol=1e-12)
    subspace = constructed_scores(WEIGHT_MEASURES["subspace"]).rotation_path
    torch.testing.assert_close(subspace, THETA.cos().square(), rtol=1e-9, atol=1e-12)


def test_a_jump_or_a_rise_is_caught():
    c = constructed_scores(WEIGHT_MEASURES["frobenius"])
    jumpy = type(c)(c.aligned_rank_one, c.aligned, c.orthogonal, torch.where(THETA < 0.7, c.rotation_path[0], 0.0))
    rising = type(c)(c.aligned_rank_one, c.aligned, c.orthogonal, c.rotation_path.flip(0))
    assert jumpy.monotone and not jumpy.smooth
    assert not rising.monotone


# what docs/measures.md and the seeds lead one to expect; the table confirms it
EVERY_SCORE = set(WEIGHT_MEASURES) | {"share", "match", "ov_copying"}
INVARIANT_UNDER = {
    "residual rotation": EVERY_SCORE,
    # the data-aware share reads the probe pass: each part's term of a score, which no reparametrisation moves
    "residual GL": {"whitened", "whitened_resid", "token_space", "share", "match", "ov_copying"},
    "head GL (V, O)": EVERY_SCORE,
    "head GL (Q, K)": EVERY_SCORE,
    # the stream is unchanged, its split between tokens and positions is not: token-space scores see it
    "embedding shift": EVERY_SCORE - {"token_space", "match", "ov_copying"},
    # LayerNorm only: every writer's rows moved along 1, which no reader sees (the writers are centred)
    "ones shift": EVERY_SCORE,
}
NORMALIZATIONS = ("none", "layernorm", "rmsnorm")
SYMMETRY_UNDER = {  # where each map preserves the function (a rotation: with unit gains, and under LayerNorm fixing 1)
    "residual rotation": set(NORMALIZATIONS),
    "residual GL": {"none"},
    "head GL (V, O)": set(NORMALIZATIONS),
    "head GL (Q, K)": set(NORMALIZATIONS),
    "embedding shift": set(NORMALIZATIONS),
    "ones shift": {"layernorm"},
}


@pytest.fixture(scope="module")
def trained_table():  # normalization none
    model = train_small_model(steps=150)
    return axiom_table(model, make_probe_batch(0, 8, 16, 256).tokens)


def test_axiom_4_reparametrisations_preserve_the_logits(trained_table):
    for name, inv in trained_table.invariance.items():
        assert inv.logit_change < 1e-9, name  # float64; the command's tolerance is 1e-5


@pytest.mark.parametrize("transform", [t for t in INVARIANT_UNDER if t != "ones shift"])
def test_axiom_4_which_measures_are_invariant(trained_table, transform):
    inv = trained_table.invariance[transform]
    for measure, change in inv.score_change.items():
        if measure in INVARIANT_UNDER[transform]:
            assert change < 1e-9, (measure, change)
        else:
            assert change > 1e-2, (measure, change)  # not rounding: a real change


def unit_gains(model):
    """The same function with every norm's gain folded into the weights that read it (``W_Q, W_K, W_V``,
    ``W_U``) and the gains set to 1, where a residual rotation is a symmetry (docs/measures.md, measure 4)."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for layer in new.layers:
            for name in ("W_Q", "W_K", "W_V"):
                getattr(layer, name).mul_(layer.norm.weight[:, None])
            layer.norm.weight.fill_(1.0)
        new.W_U.mul_(new.final_norm.weight[:, None])
        new.final_norm.weight.fill_(1.0)
    return new


@pytest.mark.parametrize("gains", ["random", "unit"])
@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
def test_axiom_4_under_normalization(normalization, gains):
    """Each map preserves the logits exactly where docs/measures.md says it does (the rotation only
    with unit gains; under LayerNorm it fixes 1, and the ones shift is one more map), and there every
    score it claims is invariant is (the others are reported as changing); elsewhere the logit
    check catches it. (Normalization none: the trained table above. d_vocab 40 > d_model 24, so the
    token Gram has full rank and token space is well defined.)"""
    torch.manual_seed(0)
    model = AttentionOnlyTransformer(TransformerShape(2, 3, 24, 5, 17, 40, normalization))
    with torch.no_grad():
        for norm in [*(layer.norm for layer in model.layers), model.final_norm]:
            norm.weight.uniform_(0.5, 1.5)
    model = unit_gains(model) if gains == "unit" else model
    table = axiom_table(model, torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(0)))
    assert set(table.invariance) == set(SYMMETRY_UNDER) - ({"ones shift"} if normalization != "layernorm" else set())
    for transform, inv in table.invariance.items():
        symmetry = normalization in SYMMETRY_UNDER[transform] and (transform != "residual rotation" or gains == "unit")
        if not symmetry:
            assert inv.logit_change > 1e-3, transform
            continue
        assert inv.logit_change < 1e-9, transform
        for measure, change in inv.score_change.items():
            if measure in INVARIANT_UNDER[transform]:
                assert change < 1e-9, (transform, measure, change)
            else:
                assert change > 1e-2, (transform, measure, change)


def test_the_logit_check_catches_a_map_that_is_no_symmetry():
    """With LayerNorm a residual GL transform changes the function: the check must say so."""
    model = random_model("layernorm", n_layers=2, n_heads=2)
    table = axiom_table(model, torch.randint(0, 11, (2, 17)), measures=("frobenius",))
    assert not table.invariance["residual GL"].function_preserved
    assert table.invariance["head GL (V, O)"].function_preserved  # head-internal maps survive any norm


@pytest.mark.slow
def test_axioms_command_prints_the_table():
    result = module("bench.axiom_table", "--steps", "20")  # as `python -m`, in this process
    assert result.returncode == 0, result.stderr
    rows = {
        line.split("|")[1].strip(): line
        for line in result.stdout.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert set(rows) == {"measure", *WEIGHT_MEASURES, "share", "match", "ov_copying"}
    assert rows["whitened"].count("invariant") == rows["whitened_resid"].count("invariant") == 5
    assert rows["share"].count("invariant") == 5 and "n/a (reads the probe pass)" in rows["share"]
    assert (
        rows["token_space"].count("invariant") == 4 and "**changes**" in rows["token_space"].split("|")[10]
    )  # the embedding shift
    assert "**changes**" in rows["frobenius"].split("|")[7]  # the residual GL column
    bad = module("bench.axiom_table", "--steps", "-1")
    assert bad.returncode == 2 and "--steps=-1" in bad.stderr
