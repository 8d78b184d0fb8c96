"""Scores of the weights' circuits: copying (of each head's OV circuit, and Olsson et al.'s evaluator
on the probe) and QK matching (of each pair)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metrics.heads.circuit_scores import MATCHING, copying_scores, folded_unembedding, matching_scores
from metrics.heads.empirical_copying import empirical_copying
from metrics.tracked.base import Every, Output, PerHead, PerPair, ProbeRun, TrackedQuantity


@dataclass(frozen=True)
class CopyingScores:
    """Per head ``[L, H]``: the OV circuit's eigenvalue copying score (Elhage et al. 2021), Olsson et
    al. 2022's empirical evaluator on the probe (``2 r - 1``, r the share of the raise over the
    sequence's tokens) and how often a head raises the token it attends to most."""

    weight: Tensor
    empirical: Tensor
    top_rate: Tensor


class Copying(TrackedQuantity):
    """``heads/copying``, ``heads/copying_empirical``, ``heads/copying_top_rate``."""

    name, label = "copying", "copying scores"
    Options = Every
    reads_head_writes = True

    def measure(self, run: ProbeRun) -> CopyingScores:
        model, probe = run.model, run.probe
        empirical = empirical_copying(
            torch.stack(run.cache["head_out"]), run.patterns, run.tokens, folded_unembedding(model), probe.first_start
        )
        return CopyingScores(
            copying_scores(model, run.circuits).cpu(), empirical.score.cpu().double(), empirical.top_rate.cpu().double()
        )

    def outputs(self, result: CopyingScores, run: ProbeRun) -> list[Output]:
        return [
            PerHead("heads/copying", result.weight),
            PerHead("heads/copying_empirical", result.empirical),
            PerHead("heads/copying_top_rate", result.top_rate),
        ]


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
