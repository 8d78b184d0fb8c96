"""Stable, ``/``-namespaced metric keys, and the flattening of a snapshot into them.

``comp/{Q,K,V}/{measure}/L0H1->L1H3``, ``comp/{Q,K,V}/{measure}_minus_baseline/...``,
``comp/baseline/{measure}`` (+ ``_stderr``),
``heads/{induction,prev_token,duplicate,copying,copying_empirical,copying_top_rate}/L1H3`` (+ ``/top``),
``match/L0H1->L1H3`` (QK matching score), ``loss/{first_occurrence,repeated,icl_score}``,
``circuit/K/{measure}`` (+ ``_minus_baseline``, ``_minus_baseline_rank``),
``circuit/{writer,reader}_{layer,head}``; at ablation steps ``ablation/{loss_change,pattern_change}/L0H1->L1H3``
and ``validity/{loss_change,pattern_change}/{measure or match}/{rank_of_truth,spearman}``.
"""

from __future__ import annotations

from metrics.snapshot import Snapshot

HEAD_SCORES = {
    "induction": "induction",
    "prev_token": "previous_token",
    "duplicate": "duplicate_token",
    "copying": "copying",
    "copying_empirical": "empirical_copying",
    "copying_top_rate": "copying_top_rate",
}


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def pair_name(writer: tuple[int, int], reader: tuple[int, int]) -> str:
    return f"{head_name(*writer)}->{head_name(*reader)}"


def snapshot_metrics(snap: Snapshot) -> dict[str, float]:
    """Every scalar of ``snap`` under its key; masked (NaN) pairs are never emitted."""
    metrics: dict[str, float] = {
        "loss/first_occurrence": snap.first_occurrence_loss,
        "loss/repeated": snap.repeated_loss,
        "loss/icl_score": snap.icl_score,
    }
    for key, attribute in HEAD_SCORES.items():
        scores = getattr(snap, attribute)  # (L, H)
        for (layer, head), value in _entries(scores):
            metrics[f"heads/{key}/{head_name(layer, head)}"] = value
        metrics[f"heads/{key}/top"] = float(scores.max())
    for (l1, h1, l2, h2), value in _entries(snap.matching):
        metrics[f"match/{pair_name((l1, h1), (l2, h2))}"] = value
    for measure, by_kind in snap.composition.items():
        baseline = snap.baselines[measure]
        metrics[f"comp/baseline/{measure}"] = baseline.mean
        metrics[f"comp/baseline/{measure}_stderr"] = baseline.stderr
        for kind, scores in by_kind.items():
            above_baseline = snap.minus_baseline(measure, kind)
            for index, value in _entries(scores):
                name = pair_name(index[:2], index[2:])
                metrics[f"comp/{kind}/{measure}/{name}"] = value
                metrics[f"comp/{kind}/{measure}_minus_baseline/{name}"] = float(above_baseline[index])
        if snap.circuit is not None:
            (l1, h1), (l2, h2) = snap.circuit
            metrics[f"circuit/K/{measure}"] = float(by_kind["K"][l1, h1, l2, h2])
            metrics[f"circuit/K/{measure}_minus_baseline"] = float(snap.minus_baseline(measure, "K")[l1, h1, l2, h2])
            metrics[f"circuit/K/{measure}_minus_baseline_rank"] = float(snap.pair_rank(measure, "K", snap.circuit))
    if snap.ablation is not None:
        for effect, values in snap.ablation.effects().items():
            for (l1, h1, l2, h2), value in _entries(values):
                metrics[f"ablation/{effect}/{pair_name((l1, h1), (l2, h2))}"] = value
    for effect, by_measure in (snap.validity or {}).items():
        for measure, agreed in by_measure.items():
            metrics[f"validity/{effect}/{measure}/rank_of_truth"] = float(agreed.rank_of_truth)
            if agreed.spearman == agreed.spearman:  # undefined (NaN) when a side is constant
                metrics[f"validity/{effect}/{measure}/spearman"] = agreed.spearman
    if snap.circuit is not None:
        (l1, h1), (l2, h2) = snap.circuit
        metrics.update({"circuit/writer_layer": l1, "circuit/writer_head": h1, "circuit/reader_layer": l2, "circuit/reader_head": h2})
    return metrics


def _entries(scores):
    """``(index tuple, float)`` for every non-NaN entry of a tensor."""
    valid = ~scores.isnan()
    return zip(map(tuple, valid.nonzero().tolist()), scores[valid].tolist())  # nonzero and masking share row-major order
