"""The metric keys: one per pair on small models, a few hundred summary keys on any shape, and as
many as the tracked quantities' outputs say, counted here from those outputs (not by hand)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from metrics.tracked.base import PerHead, PerPair, Scalar, registered_measures
from records.keys import pair_key_count, scored_pair_count
from tests.helpers import MEASURES, fake_quantities, fake_results, fake_snapshot, snapshot_keys, snapshot_of

PER_HEAD_KEY = re.compile(r"/L\d+H\d+$")


def expected_key_count(snap, per_pair: bool, top_pairs: int = 3, max_head_keys: int = 32) -> int:
    """How many keys a snapshot's outputs make, by the rules of records/keys.py written out per kind
    (every value of the fakes is finite where it is scored)."""
    count = 0
    for output in snap.outputs:
        if isinstance(output, Scalar):
            count += 1
        elif isinstance(output, PerHead):
            heads = output.values.numel()
            count += heads + 1 if heads <= max_head_keys else 2
        elif isinstance(output, PerPair):
            L, H = output.values.shape[:2]
            count += int(output.circuit is not None and snap.circuit is not None)
            if per_pair:
                count += scored_pair_count(L, H)
            elif scored_pair_count(L, H):
                count += 2 + (3 * min(top_pairs, scored_pair_count(L, H)) if output.top else 0)
    return count


@pytest.mark.parametrize("shape", [(2, 2), (3, 2), (4, 8), (12, 12), (1, 4)])
def test_every_output_makes_the_keys_its_kind_says(shape):
    """For the default quantities at each shape, the keys emitted are exactly what each output's kind
    makes (per pair, or summaries beyond ``max_pair_keys``), so a new quantity's keys are counted
    from what it declares."""
    snap = fake_snapshot(*shape)
    keys_per_pair = sum(q.pair_keys for q in fake_quantities().values())
    per_pair = pair_key_count(*shape, keys_per_pair) <= 300
    assert len(snapshot_keys(snap)) == expected_key_count(snap, per_pair)


def test_the_default_shape_logs_every_pair_and_big_shapes_only_summaries():
    """2 x 2 (4 pairs: the default run) gets one key per pair, a 12 x 12 model summaries only, and
    any shape at most a few hundred keys with the default quantities."""
    keys_per_pair = sum(q.pair_keys for q in fake_quantities().values())
    assert keys_per_pair == 6 * 8 + 3 + 1 + 2  # 8 weight-based measures, the share, matching, 2 ablation effects
    small = snapshot_keys(fake_snapshot(2, 2))
    assert not [k for k in small if k.startswith("top/") or k.endswith(("/max", "/mean", "/top_head"))]
    big = snapshot_keys(fake_snapshot(12, 12))
    assert not [k for k in big if "->" in k or PER_HEAD_KEY.search(k)]
    most = max(len(snapshot_keys(fake_snapshot(*shape))) for shape in ((3, 5), (4, 8), (6, 6), (8, 16), (16, 4)))
    # 32 heads: the last shape with keys per head. 666 keys: every behaviour's scores per head (8 families
    # of 32 at the repeated task: 5 where a head attends, 3 what it writes), each head's type, and the rest.
    # The bound is the shape's own count plus room for one more family.
    per_head_families = 8 + 1  # the behaviours and the type
    assert most <= len(snapshot_keys(fake_snapshot(4, 8))) <= 666 + 32 and per_head_families * 32 < 666


def test_per_pair_keys_read_the_right_entries():
    snap = fake_snapshot(2, 2)
    composition, share = snap["composition"], snap["composition"].extras["share"]
    metrics = snapshot_keys(snap)
    assert metrics["comp/V/share/L0H0->L1H1"] == composition.scores["share"]["V"][0, 0, 1, 1].item()
    assert metrics["circuit/share/K/positions"] == share.positions["K"][1, 0].item()
    assert not [k for k in metrics if k.startswith(("comp/baseline/share", "comp/K/share_minus"))]
    (l1, h1), (l2, h2) = snap.circuit
    circuit = f"L{l1}H{h1}->L{l2}H{h2}"
    assert metrics["circuit/ablation/loss_change"] == metrics[f"ablation/loss_change/{circuit}"]
    assert metrics["circuit/ablation/pattern_change"] == metrics[f"ablation/pattern_change/{circuit}"]
    assert metrics["circuit/match"] == metrics[f"match/{circuit}"]
    assert metrics["comp/K/frobenius/L0H1->L1H0"] == composition.scores["frobenius"]["K"][0, 1, 1, 0].item()
    assert metrics["comp/Q/subspace_minus_baseline/L0H0->L1H1"] == pytest.approx(
        composition.scores["subspace"]["Q"][0, 0, 1, 1].item() - composition.baselines["subspace"].mean
    )
    assert metrics["match/L0H1->L1H1"] == snap["matching"][0, 1, 1, 1].item()
    assert metrics["ablation/loss_change/L0H0->L1H0"] == snap["ablation"].effects.loss_change[0, 0, 1, 0].item()
    induction = snap["behaviour"].score("induction")
    assert metrics["heads/induction/L1H1"] == induction[1, 1].item()
    assert metrics["heads/induction/top"] == induction.max().item()
    assert metrics["heads/successor/L1H0"] == snap["writes"].score("successor")[1, 0].item()
    assert "comp/K/frobenius/L1H0->L0H0" not in metrics  # masked pairs never emitted


def test_the_mode_switches_on_the_number_of_pair_keys():
    assert scored_pair_count(2, 8) == 64 and scored_pair_count(3, 5) == 75 and scored_pair_count(1, 9) == 0
    assert pair_key_count(2, 2, 54) == 216 and pair_key_count(1, 9, 54) == 0
    frobenius = ("frobenius",)  # 6 keys a pair, and matching's and the ablation's 3
    assert "comp/K/frobenius/L0H3->L1H3" in snapshot_keys(fake_snapshot(2, 4, frobenius), frobenius)  # 16 x 9 = 144
    assert not [k for k in snapshot_keys(fake_snapshot(2, 6, frobenius), frobenius) if "->" in k]  # 36 x 9 > 300
    summary = snapshot_keys(fake_snapshot(3, 5, frobenius), frobenius)
    assert "comp/K/frobenius/max" in summary and not [k for k in summary if "->" in k]
    small = snapshot_keys(fake_snapshot(2, 2, frobenius), frobenius, max_pair_keys=3)  # the limit is a parameter
    assert "top/K/frobenius/1" in small and "comp/K/frobenius/L0H0->L1H0" not in small


def test_summary_statistics_and_top_pairs_are_the_right_numbers():
    results = fake_results(3, 2, ("frobenius",))
    k = results["composition"].scores["frobenius"]["K"]
    k[0, 1, 2, 0] = 5.0  # the best pair: writer L0H1 = 1, reader L2H0 = 4
    k[1, 0, 2, 1] = 4.0  # second: writer L1H0 = 2, reader L2H1 = 5
    k[0, 0, 1, 1] = 4.0  # tied with it, lower flat pair index (writer 0): ranked before it
    snap = snapshot_of(results, ("frobenius",))
    metrics = snapshot_keys(snap, ("frobenius",), max_pair_keys=0, top_pairs=3)
    scored = k[~k.isnan()]
    assert metrics["comp/K/frobenius/max"] == 5.0
    assert metrics["comp/K/frobenius/mean"] == pytest.approx(scored.mean().item())
    assert metrics["comp/K/frobenius_minus_baseline/mean"] == pytest.approx(scored.mean().item() - 0.1)
    q = results["composition"].scores["frobenius"]["Q"]
    assert metrics["comp/Q/frobenius/max"] == pytest.approx(q.nan_to_num(-1).max().item())
    assert [metrics[f"top/K/frobenius/{i}"] for i in (1, 2, 3)] == [5.0, 4.0, 4.0]
    assert [(metrics[f"top/K/frobenius/{i}/writer"], metrics[f"top/K/frobenius/{i}/reader"]) for i in (1, 2, 3)] == [
        (1, 4),
        (0, 3),
        (2, 5),
    ]
    assert "top/K/frobenius/4" not in metrics and "top/Q/frobenius/1" not in metrics
    # the circuit pair (L0H1 -> L1H0) keeps its keys, and gets its matching score and ablation effects
    effects, matching = results["ablation"].effects, results["matching"]
    assert metrics["circuit/K/frobenius"] == k[0, 1, 1, 0].item()
    assert metrics["circuit/K/frobenius_minus_baseline_rank"] == results["composition"].pair_rank(
        "frobenius", "K", snap.circuit
    )
    assert metrics["circuit/match"] == matching[0, 1, 1, 0].item()
    assert metrics["circuit/ablation/pattern_change"] == effects.pattern_change[0, 1, 1, 0].item()
    assert metrics["match/max"] == matching.nan_to_num(-1).max().item()
    assert metrics["ablation/loss_change/mean"] == pytest.approx(effects.loss_change.nanmean().item())
    best = effects.loss_change.nan_to_num(-1).flatten().argmax().item()
    assert (metrics["top/ablation/loss_change/1/writer"], metrics["top/ablation/loss_change/1/reader"]) == divmod(
        best, 6
    )


def test_fewer_pairs_than_top_pairs_and_nan_pairs():
    results = fake_results(2, 1, ("frobenius",))  # a single scored pair
    results["composition"].scores["frobenius"]["K"][0, 0, 1, 0] = float("nan")  # and its score undefined
    snap = snapshot_of(results, ("frobenius",))
    metrics = snapshot_keys(snap, ("frobenius",), max_pair_keys=0)
    assert not [k for k in metrics if k.startswith(("comp/K/frobenius/", "top/K/"))]
    assert metrics["top/match/1"] == results["matching"][0, 0, 1, 0].item() and "top/match/2" not in metrics
    per_pair = snapshot_keys(snap, ("frobenius",))
    assert "comp/K/frobenius/L0H0->L1H0" not in per_pair and "comp/Q/frobenius/L0H0->L1H0" in per_pair


def test_many_heads_log_only_the_best_head():
    results = fake_results(12, 12, ("frobenius",))
    reading = results["behaviour"]
    reading.scores[7, 3, reading.names.index("induction")] = 2.0
    metrics = snapshot_keys(snapshot_of(results, ("frobenius",)), ("frobenius",))
    assert metrics["heads/induction/top"] == 2.0 and metrics["heads/induction/top_head"] == 7 * 12 + 3
    assert "heads/induction/L7H3" not in metrics
    assert "heads/induction/L1H1" in snapshot_keys(fake_snapshot(4, 8, ("frobenius",)), ("frobenius",))  # 32: per head


@pytest.mark.parametrize("max_pair_keys", [300, 0])
def test_quantities_not_measured_emit_no_keys(max_pair_keys):
    snap = fake_snapshot(2, 2, ("frobenius",), writes=None, matching=None, ablation=None, validity=None)
    metrics = snapshot_keys(snap, ("frobenius",), max_pair_keys=max_pair_keys)
    unmeasured = (
        "heads/copying",
        "heads/ov_copying",
        "heads/successor",
        "match",
        "ablation",
        "validity",
        "top/match",
        "circuit/match",
        "circuit/ablation",
    )
    assert not [k for k in metrics if k.startswith(unmeasured)]
    assert "heads/induction/top" in metrics and "circuit/K/frobenius" in metrics and "loss/repeated" in metrics
    bare = fake_snapshot(2, 2, ("frobenius",), composition=None, matching=None, ablation=None)
    assert not [k for k in snapshot_keys(bare, ("frobenius",)) if k.startswith(("comp/", "circuit/K"))]


def test_one_layer_has_no_pair_keys():
    snap = fake_snapshot(1, 4, ablation=None, validity=None)
    metrics = snapshot_keys(snap)
    assert not [k for k in metrics if "->" in k or k.startswith(("top/", "circuit/"))]
    assert metrics["comp/baseline/frobenius"] == 0.1


def test_float32_scores_keep_their_precision():
    """On GPU runs the tensors may be float32: minus-baseline values are computed in that precision, as before."""
    results = fake_results(2, 2, ("frobenius",))
    scores = results["composition"].scores["frobenius"]
    scores["K"] = scores["K"].float()
    metrics = snapshot_keys(snapshot_of(results, ("frobenius",)), ("frobenius",))
    expected = (scores["K"] - 0.1)[0, 1, 1, 0].item()
    assert metrics["comp/K/frobenius_minus_baseline/L0H1->L1H0"] == expected
    assert metrics["circuit/K/frobenius_minus_baseline"] == expected
    assert isinstance(metrics["comp/K/frobenius/L0H1->L1H0"], float)
    assert np.isfinite(list(metrics.values())).all()


def test_half_precision_scores_are_read():
    results = fake_results(2, 2, ("frobenius",))
    scores = results["composition"].scores["frobenius"]
    scores["K"] = scores["K"].bfloat16()
    metrics = snapshot_keys(snapshot_of(results, ("frobenius",)), ("frobenius",))
    assert metrics["comp/K/frobenius/L0H1->L1H0"] == scores["K"][0, 1, 1, 0].float().item()


def test_a_real_snapshot_flows_through_keys_store_and_heatmap(tmp_path):
    """``take_snapshot``'s own tensors (dtypes, devices, ablation), not the fake's: the keys read the
    right entries in both modes, the store keeps them, the heatmap draws them."""
    from data.probe import make_probe_batch
    from metrics.snapshot import take_snapshot
    from records.heatmap_pixels import heatmap_image
    from records.tensor_store import TensorStore, read_tensor_store, snapshot_tensors
    from tests.helpers import random_model

    measures = ("frobenius", "subspace")
    snap = take_snapshot(
        random_model(n_layers=3, n_heads=3),
        make_probe_batch(0, 4, 8, 10),
        composition={"measures": list(measures), "baseline_samples": 50},
        ablation=True,
        matching=True,
    )
    composition = snap["composition"]
    k = composition.scores["subspace"]["K"]
    per_pair = snapshot_keys(snap, measures, max_pair_keys=1000)  # 27 pairs x 15 keys
    assert per_pair["comp/K/subspace/L0H2->L2H1"] == k[0, 2, 2, 1].item()
    assert per_pair["ablation/pattern_change/L1H0->L2H2"] == snap["ablation"].effects.pattern_change[1, 0, 2, 2].item()
    summary = snapshot_keys(snap, measures, max_pair_keys=0)
    best = int(k.nan_to_num(float("-inf")).flatten().argmax())
    assert (summary["top/K/subspace/1/writer"], summary["top/K/subspace/1/reader"]) == divmod(best, 9)
    assert summary["top/K/subspace/1"] == k.flatten()[best].item() == summary["comp/K/subspace/max"]
    assert summary["validity/loss_change/match/rank_of_truth"] == per_pair["validity/loss_change/match/rank_of_truth"]
    with TensorStore(tmp_path) as store:
        store.append(0, snapshot_tensors(snap.outputs))
    stored = read_tensor_store(tmp_path)
    np.testing.assert_allclose(stored["comp/K/subspace"][1][0], k.numpy(), rtol=1e-6)  # float32 on disk, NaN kept
    induction = snap["behaviour"].score("induction").numpy()
    np.testing.assert_allclose(stored["heads/induction"][1][0], induction, rtol=1e-6)
    image = heatmap_image({kind: composition.minus_baseline("subspace", kind).numpy() for kind in "QKV"})
    assert image.shape == (6 * 33 + 1, 3 * 199 + 16, 3)  # 6 writers x 6 readers, 33-pixel cells, one line


def test_the_default_measures_are_registered_ones():
    assert MEASURES == tuple(fake_quantities()["composition"].options.measures)
    assert set(MEASURES) <= set(registered_measures())
    assert torch.is_tensor(fake_results(2, 2)["behaviour"].score("induction"))
