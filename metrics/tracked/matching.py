"""A score of the weights' circuits: QK matching of each pair (a head's own copying scores are behaviours:
:mod:`metrics.tracked.head_behaviour`)."""

from __future__ import annotations

from torch import Tensor

from metrics.heads.circuit_scores import MATCHING, matching_scores
from metrics.tracked.base import Every, Output, PerPair, ProbeRun, TrackedQuantity


class Matching(TrackedQuantity):
    """QK matching score of every pair (Olsson et al. 2022), ``[L, H, L, H]``: ``match/...``; also at
    every ablation, which judges it beside the composition measures."""

    name = "matching"
    Options = Every
    runs_with = ("ablation",)
    pair_keys = 1

    def applies(self, model) -> bool:
        return model.shape.n_layers > 1

    def measure(self, run: ProbeRun) -> Tensor:
        return matching_scores(run.model, run.circuits).cpu()

    def outputs(self, result: Tensor, run: ProbeRun) -> list[Output]:
        return [PerPair(MATCHING, result, circuit=MATCHING, top=f"top/{MATCHING}")]
