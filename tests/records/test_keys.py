"""The metric keys: today's per-pair keys on small models, a few hundred summary keys on any shape."""

from __future__ import annotations

import re

import numpy as np
import pytest

from records.keys import pair_key_count, scored_pair_count, snapshot_metrics
from tests.helpers import fake_snapshot

PER_HEAD_KEY = re.compile(r"/L\d+H\d+$")


def test_default_shape_keeps_every_per_pair_key():
    """2 layers x 2 heads, 8 weight-based measures and the share, ablation: 386 keys, one per pair,
    and no summary keys."""
    snap = fake_snapshot(2, 2)
    metrics = snapshot_metrics(snap)
    # 3 losses + 6 head scores x (4 heads + top) + 8 baselines x 2
    # + 4 pairs x (8 measures x 3 kinds x 2 + the share's 3 kinds + match + 2 effects)
    # + 8 x 3 circuit/K + circuit/K/share + 4 circuit heads + the circuit's match and 2 effects
    # + 2 effects x 10 scorers x (rank + spearman) + 10 scorers x (writer, reader) x (rank + spearman) for the loss effect
    # + the circuit reader's share parts: 3 kinds x (tokens, positions, biases)
    assert len(metrics) == 3 + 30 + 16 + 4 * 54 + 25 + 4 + 3 + 40 + 40 + 9 == 386
    assert metrics["comp/V/share/L0H0->L1H1"] == snap.composition["share"]["V"][0, 0, 1, 1].item()
    assert metrics["circuit/share/K/positions"] == snap.share_parts.positions["K"][1, 0].item()
    assert not [k for k in metrics if k.startswith(("comp/baseline/share", "comp/K/share_minus"))]
    (l1, h1), (l2, h2) = snap.circuit
    circuit = f"L{l1}H{h1}->L{l2}H{h2}"
    assert metrics["circuit/ablation/loss_change"] == metrics[f"ablation/loss_change/{circuit}"]
    assert metrics["circuit/ablation/pattern_change"] == metrics[f"ablation/pattern_change/{circuit}"]
    assert metrics["circuit/match"] == metrics[f"match/{circuit}"]
    assert metrics["comp/K/frobenius/L0H1->L1H0"] == snap.composition["frobenius"]["K"][0, 1, 1, 0].item()
    assert metrics["comp/Q/subspace_minus_baseline/L0H0->L1H1"] == pytest.approx(
        snap.composition["subspace"]["Q"][0, 0, 1, 1].item() - snap.baselines["subspace"].mean
    )
    assert metrics["match/L0H1->L1H1"] == snap.matching[0, 1, 1, 1].item()
    assert metrics["ablation/loss_change/L0H0->L1H0"] == snap.ablation.loss_change[0, 0, 1, 0].item()
    assert metrics["heads/induction/L1H1"] == snap.induction[1, 1].item()
    assert metrics["heads/induction/top"] == snap.induction.max().item()
    assert "comp/K/frobenius/L1H0->L0H0" not in metrics  # masked pairs never emitted
    assert not [k for k in metrics if k.startswith("top/") or k.endswith(("/max", "/mean", "/top_head"))]


def test_the_module_docstrings_pair_key_counts_are_what_per_pair_mode_would_emit():
    from records import keys

    for n_layers, n_heads, stated in ((4, 8, "20,736"), (12, 12, "513,216")):
        pairs = n_heads**2 * n_layers * (n_layers - 1) // 2
        assert keys.pair_key_count(pairs, 8, 1) == int(stated.replace(",", "")) and stated in keys.__doc__
    emitted = snapshot_metrics(fake_snapshot(4, 8), max_pair_keys=10**9)
    assert len([key for key in emitted if "->" in key and not key.startswith("circuit/")]) == 20_736


def test_any_shape_emits_at_most_a_few_hundred_keys():
    """Beyond 64 pairs: summaries only (per pair, 12 x 12 would be 513,216 keys a snapshot)."""
    big = snapshot_metrics(fake_snapshot(12, 12))
    # 3 losses + 16 baselines + 102 comp max/mean + 81 top/K + 29 circuit + 12 match + 24 ablation + 80 validity
    # + 9 share parts + 12 heads
    assert len(big) == 3 + 16 + 102 + 81 + 29 + 12 + 24 + 80 + 9 + 12 == 368
    assert not [k for k in big if "->" in k or PER_HEAD_KEY.search(k)]
    mid = snapshot_metrics(fake_snapshot(4, 8))  # 384 pairs but 32 heads: heads still one key each
    assert len(mid) == 368 - 12 + 6 * 33 == 554
    for n_layers, n_heads in ((3, 5), (6, 6), (8, 16), (16, 4)):
        assert len(snapshot_metrics(fake_snapshot(n_layers, n_heads))) <= 554, (n_layers, n_heads)


def test_mode_switches_on_the_number_of_pair_keys():
    assert scored_pair_count(2, 8) == 64 and scored_pair_count(3, 5) == 75 and scored_pair_count(1, 9) == 0
    assert pair_key_count(33, 1) == 297 and pair_key_count(4, 7) == 180  # 6 M + 3 per pair
    assert "comp/K/frobenius/L0H3->L1H3" in snapshot_metrics(
        fake_snapshot(2, 4, ("frobenius",))
    )  # 16 pairs x 9 = 144: per pair
    assert not [k for k in snapshot_metrics(fake_snapshot(2, 6, ("frobenius",))) if "->" in k]
    summary = snapshot_metrics(fake_snapshot(3, 5, ("frobenius",)))
    assert "comp/K/frobenius/max" in summary and not [k for k in summary if "->" in k]
    small = snapshot_metrics(fake_snapshot(2, 2, ("frobenius",)), max_pair_keys=3)  # the limit is a parameter
    assert "top/K/frobenius/1" in small and "comp/K/frobenius/L0H0->L1H0" not in small


def test_summary_statistics_and_top_pairs_are_the_right_numbers():
    snap = fake_snapshot(3, 2, ("frobenius",))
    k = snap.composition["frobenius"]["K"]
    k[0, 1, 2, 0] = 5.0  # the best pair: writer L0H1 = 1, reader L2H0 = 4
    k[1, 0, 2, 1] = 4.0  # second: writer L1H0 = 2, reader L2H1 = 5
    k[0, 0, 1, 1] = 4.0  # tied with it, lower flat pair index (writer 0): ranked before it
    metrics = snapshot_metrics(snap, max_pair_keys=0, top_pairs=3)
    scored = k[~k.isnan()]
    assert metrics["comp/K/frobenius/max"] == 5.0
    assert metrics["comp/K/frobenius/mean"] == pytest.approx(scored.mean().item())
    assert metrics["comp/K/frobenius_minus_baseline/mean"] == pytest.approx(scored.mean().item() - 0.1)
    assert metrics["comp/Q/frobenius/max"] == pytest.approx(
        snap.composition["frobenius"]["Q"].nan_to_num(-1).max().item()
    )
    assert [metrics[f"top/K/frobenius/{i}"] for i in (1, 2, 3)] == [5.0, 4.0, 4.0]
    assert [(metrics[f"top/K/frobenius/{i}/writer"], metrics[f"top/K/frobenius/{i}/reader"]) for i in (1, 2, 3)] == [
        (1, 4),
        (0, 3),
        (2, 5),
    ]
    assert "top/K/frobenius/4" not in metrics and "top/Q/frobenius/1" not in metrics
    # the circuit pair (L0H1 -> L1H0) keeps its keys, and gets its matching score and ablation effects
    assert metrics["circuit/K/frobenius"] == k[0, 1, 1, 0].item()
    assert metrics["circuit/K/frobenius_minus_baseline_rank"] == snap.pair_rank("frobenius", "K", snap.circuit)
    assert metrics["circuit/match"] == snap.matching[0, 1, 1, 0].item()
    assert metrics["circuit/ablation/pattern_change"] == snap.ablation.pattern_change[0, 1, 1, 0].item()
    assert metrics["match/max"] == snap.matching.nan_to_num(-1).max().item()
    assert metrics["ablation/loss_change/mean"] == pytest.approx(snap.ablation.loss_change.nanmean().item())
    best = snap.ablation.loss_change.nan_to_num(-1).flatten().argmax().item()
    assert (metrics["top/ablation/loss_change/1/writer"], metrics["top/ablation/loss_change/1/reader"]) == divmod(
        best, 6
    )


def test_fewer_pairs_than_top_pairs_and_nan_pairs():
    snap = fake_snapshot(2, 1, ("frobenius",))  # a single scored pair
    snap.composition["frobenius"]["K"][0, 0, 1, 0] = float("nan")  # and its score undefined
    metrics = snapshot_metrics(snap, max_pair_keys=0)
    assert not [k for k in metrics if k.startswith(("comp/K/frobenius/", "top/K/"))]
    assert metrics["top/match/1"] == snap.matching[0, 0, 1, 0].item() and "top/match/2" not in metrics
    per_pair = snapshot_metrics(snap)
    assert "comp/K/frobenius/L0H0->L1H0" not in per_pair and "comp/Q/frobenius/L0H0->L1H0" in per_pair


def test_many_heads_log_only_the_best_head():
    snap = fake_snapshot(12, 12, ("frobenius",))
    snap.induction[7, 3] = 2.0
    metrics = snapshot_metrics(snap)
    assert metrics["heads/induction/top"] == 2.0 and metrics["heads/induction/top_head"] == 7 * 12 + 3
    assert "heads/induction/L7H3" not in metrics
    assert "heads/induction/L1H1" in snapshot_metrics(fake_snapshot(4, 8, ("frobenius",)))  # 32 heads: per head


@pytest.mark.parametrize("max_pair_keys", [300, 0])
def test_parts_that_are_none_emit_no_keys(max_pair_keys):
    snap = fake_snapshot(
        2,
        2,
        ("frobenius",),
        empirical_copying=None,
        copying_top_rate=None,
        matching=None,
        ablation=None,
        validity=None,
        icl_score=None,
    )
    metrics = snapshot_metrics(snap, max_pair_keys=max_pair_keys)
    assert not [
        k
        for k in metrics
        if k.startswith(
            (
                "heads/copying_empirical",
                "heads/copying_top_rate",
                "match",
                "ablation",
                "validity",
                "top/match",
                "circuit/match",
                "loss/icl",
            )
        )
    ]
    assert "heads/copying/top" in metrics and "circuit/K/frobenius" in metrics and "loss/repeated" in metrics
    bare = fake_snapshot(2, 2, ("frobenius",), composition={}, baselines={}, matching=None, ablation=None)
    assert not [k for k in snapshot_metrics(bare) if k.startswith(("comp/", "circuit/K"))]


def test_one_layer_has_no_pair_keys():
    metrics = snapshot_metrics(fake_snapshot(1, 4, ablation=None, validity=None))
    assert not [k for k in metrics if "->" in k or k.startswith(("top/", "circuit/"))]
    assert metrics["comp/baseline/frobenius"] == 0.1


def test_float32_scores_keep_their_precision():
    """On GPU runs the tensors may be float32: minus-baseline values are computed in that precision, as before."""
    snap = fake_snapshot(2, 2, ("frobenius",))
    snap.composition["frobenius"]["K"] = snap.composition["frobenius"]["K"].float()
    metrics = snapshot_metrics(snap)
    expected = (snap.composition["frobenius"]["K"] - 0.1)[0, 1, 1, 0].item()
    assert metrics["comp/K/frobenius_minus_baseline/L0H1->L1H0"] == expected
    assert metrics["circuit/K/frobenius_minus_baseline"] == expected
    assert isinstance(metrics["comp/K/frobenius/L0H1->L1H0"], float)
    assert np.isfinite(list(metrics.values())).all()


def test_a_real_snapshot_flows_through_keys_store_and_heatmap(tmp_path):
    """``take_snapshot``'s own tensors (dtypes, devices, ablation), not the fake's: the keys read the
    right entries in both modes, the store keeps them, the heatmap draws them."""
    from data.probe import make_probe_batch
    from metrics.snapshot import take_snapshot
    from records.tensor_store import TensorStore, read_tensor_store, snapshot_tensors
    from reports.plots import heatmap_image
    from tests.helpers import random_model

    snap = take_snapshot(
        random_model(n_layers=3, n_heads=3),
        make_probe_batch(0, 4, 8, 10),
        ("frobenius", "subspace"),
        baseline_samples=50,
        ablate=True,
    )
    k = snap.composition["subspace"]["K"]
    per_pair = snapshot_metrics(snap, max_pair_keys=1000)  # 27 pairs x 15 keys
    assert per_pair["comp/K/subspace/L0H2->L2H1"] == k[0, 2, 2, 1].item()
    assert per_pair["ablation/pattern_change/L1H0->L2H2"] == snap.ablation.pattern_change[1, 0, 2, 2].item()
    summary = snapshot_metrics(snap, max_pair_keys=0)
    best = int(k.nan_to_num(float("-inf")).flatten().argmax())
    assert (summary["top/K/subspace/1/writer"], summary["top/K/subspace/1/reader"]) == divmod(best, 9)
    assert summary["top/K/subspace/1"] == k.flatten()[best].item() == summary["comp/K/subspace/max"]
    assert summary["validity/loss_change/match/rank_of_truth"] == per_pair["validity/loss_change/match/rank_of_truth"]
    with TensorStore(tmp_path) as store:
        store.append(0, snapshot_tensors(snap))
    stored = read_tensor_store(tmp_path)
    np.testing.assert_allclose(stored["comp/K/subspace"][1][0], k.numpy(), rtol=1e-6)  # float32 on disk, NaN kept
    np.testing.assert_allclose(stored["heads/induction"][1][0], snap.induction.numpy(), rtol=1e-6)
    image = heatmap_image({kind: snap.minus_baseline("subspace", kind).numpy() for kind in "QKV"})
    assert image.shape == (6 * 33 + 1, 3 * 199 + 16, 3)  # 6 writers x 6 readers, 33-pixel cells, one line


def test_half_precision_scores_are_read():
    snap = fake_snapshot(2, 2, ("frobenius",))
    snap.composition["frobenius"]["K"] = snap.composition["frobenius"]["K"].bfloat16()
    metrics = snapshot_metrics(snap)
    assert metrics["comp/K/frobenius/L0H1->L1H0"] == snap.composition["frobenius"]["K"][0, 1, 1, 0].float().item()
