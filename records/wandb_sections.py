"""A run's W&B keys under numbered sections, so that the story is what a reader sees first.

W&B's web UI groups panels by the key's first ``/`` segment and its terminal viewer (``wandb leet``)
lays them out in the keys' sorted order, nine to a page; the tracker's key names
(:mod:`records.keys`) would put the per-pair ablation keys first. In W&B, each tracker key ``K`` is
logged as ``SECTION/K`` (the CSV and the tensor store keep ``K``):

==================  =============================================================================
``1_story``         the keys the tracked quantities tell first (their ``story``): by default the curve
                    of the phase change, repeated vs first-occurrence loss and their gap, the top
                    induction and previous-token scores, the circuit pair's Frobenius K-composition
                    (raw, its rank), its data-aware K share and its ablation loss change
``2_composition``   the circuit pair under every measure (``circuit/``) and the measures' random
                    baselines (``comp/baseline/``)
``3_ground_truth``  each measure's agreement with the ablation (``validity/``), the strategies' lines and mixture fit (``strategies/``)
``4_heads``         every head's scores, and the other scores' best head (``heads/``); every head's
                    behaviour scores and type, and how many heads have each type (``heads/behaviour/``)
``5_pairs``         every pair: composition, matching, ablation (``comp/``, ``match/``, ``ablation/``,
                    and in summary mode ``top/``)
==================  =============================================================================

Everything else (``train/loss``, ``trainer/global_step``, ``epoch``, ``images/``, tables) keeps its
name. :func:`tracker_key` undoes the prefix, so readers of W&B files (the sweep report) take runs
logged before and after alike. Each section key gets ``trainer/global_step`` as its step axis and a
summary a runs table can show: the minimum and last value of a loss, the maximum and last of a score
(``1_story/loss/repeated.min``); the run's report adds the phase-change steps and final values.
"""

from __future__ import annotations

from functools import cache

STEP_KEY = "trainer/global_step"
"""The step axis of every key (Lightning's ``WandbLogger`` logs the step under it)."""


@cache
def story() -> frozenset[str]:
    """The tracker keys of ``1_story``: those the tracked quantities tell first (their ``story``; nine
    by default, one page of ``wandb leet``, and the strategies' KLs, closest and weights); an entry
    ending in ``/`` is a prefix (``strategies/kl/``: one key per strategy of the task). The phase
    change's forecast (``forecast/*``) keeps its own name: W&B groups it as a section of its own, and the
    saved workspace draws it in its story (reports/wandb_workspace.py)."""
    from metrics.tracked.base import tracked_quantities

    return frozenset(key for quantity in tracked_quantities().values() for key in quantity.story)


SECTIONS = (
    ("2_composition", ("circuit/", "comp/baseline/")),
    ("3_ground_truth", ("validity/", "strategies/")),
    ("4_heads", ("heads/",)),
    ("5_pairs", ("comp/", "match/", "ablation/", "top/")),
)
"""Section -> the tracker key prefixes it holds, after ``1_story``; the first match wins."""

SECTION_NAMES = ("1_story", *(name for name, _ in SECTIONS))


def in_story(key: str) -> bool:
    """Whether ``key`` is one of :func:`story`'s keys, or under one of its prefixes (those ending in ``/``)."""
    return key in story() or any(key.startswith(told) for told in story() if told.endswith("/"))


def section_of(key: str) -> str | None:
    """The W&B section of tracker key ``key``; None for keys that are not the tracker's."""
    if in_story(key):
        return "1_story"
    return next((name for name, prefixes in SECTIONS if key.startswith(prefixes)), None)


@cache
def wandb_key(key: str) -> str:
    """``loss/repeated`` -> ``1_story/loss/repeated``; keys outside every section unchanged. Cached: a
    run logs the same few hundred keys at every snapshot (88 a regular default snapshot: 0.35 ms
    renamed afresh, against W&B's own 0.7 ms to log them)."""
    section = section_of(key)
    return key if section is None else f"{section}/{key}"


def tracker_key(key: str) -> str:
    """The inverse of :func:`wandb_key` (and the identity on keys logged before the sections)."""
    section, _, rest = key.partition("/")
    return rest if section in SECTION_NAMES and rest else key


def summary_of(key: str) -> str | None:
    """What W&B's summary keeps of tracker key ``key``: ``min,last`` for the losses, the in-context
    learning score and the ranks (lower is better), ``max,last`` for the other keys of the story
    and the best heads' scores, the last value (W&B's default, under the key itself) for the rest (the
    forecast's among them)."""
    if key.startswith("forecast/"):
        return None  # the last forecast is the one that counts
    if key.startswith("loss/") or key.endswith("_rank"):
        return "min,last"
    if key.startswith("strategies/kl/"):
        return "min,last"
    if in_story(key) or (key.startswith("heads/") and key.endswith("/top")):
        return "max,last"
    return None
