"""Sentence, gap, sentence again: the copying data of aslvrstn 2022 (aslvrstn, "Composition Measures
in Transformers", 2022; its training script ``composition/train_tiny_attn_only.py`` in the
``aslvrstn/mlscratchpad`` repository).

A segment is ``[BOS] s g s``: a "sentence" ``s`` of ``U{min_sentence..max_sentence}`` uniform random tokens,
a "gap" ``g`` of ``U{0..max_gap}`` uniform random tokens, then the sentence again. Segments are
packed back to back over the flattened batch, so a segment may straddle two rows (and a row need
not start with BOS), as in the seed's script. Predicting the second copy of a sentence needs an
induction circuit; nothing else in the stream is predictable.

The seed's ids are BOS = 0 and tokens 1..999; here, as in every generator of this project, random
tokens are ``0 .. n_random - 1`` and BOS is ``n_random``: the same data up to a relabelling.

Randomness: a batch is one packed stream, so its rows depend on each other; the stream is a pure
function of ``(seed, first sample id of the batch, batch size)``, which keeps training streams
resumable (a batch index fixes its ids) and DDP ranks disjoint (they draw disjoint ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from data.counter_rng import random_ints
from data.task import Task, TokenSampler

TOKEN_STREAM, SENTENCE_STREAM, GAP_STREAM = 0, 1, 2


def sentence_gap_tokens(
    seed: int,
    sample_ids: np.ndarray,
    seq_len: int,
    n_random: int,
    max_sentence: int = 50,
    max_gap: int = 50,
    min_sentence: int = 1,
) -> Tensor:
    """Token ids ``[len(sample_ids), seq_len]``: packed ``[BOS] s g s`` segments, read row by row.

    Seed 002's script copies ``sent_len + 1`` tokens for ``sent_len ~ U{1..50}``: its sentences are
    ``min_sentence=2, max_sentence=51`` here."""
    if not 1 <= min_sentence <= max_sentence or max_gap < 0:
        raise ValueError(
            f"need 1 <= min_sentence <= max_sentence and max_gap >= 0, got {min_sentence}, {max_sentence}, {max_gap}"
        )
    rows = len(sample_ids)
    total = rows * seq_len
    key = np.asarray(sample_ids[:1])
    n_segments = total // (1 + 2 * min_sentence) + 1  # a segment has at least BOS and the sentence twice
    sentences = min_sentence + random_ints(seed, key, n_segments, max_sentence - min_sentence + 1, SENTENCE_STREAM)[0]
    gaps = random_ints(seed, key, n_segments, max_gap + 1, GAP_STREAM)[0]
    fresh = random_ints(seed, key, total, n_random, TOKEN_STREAM)[0]  # consumed in order: each s once, each g
    stream = np.empty(total + 3 * (max_sentence + max_gap + 1), dtype=np.int64)
    at = used = 0
    for s, g in zip(sentences, gaps):
        if at >= total:
            break
        sentence, gap = fresh[used : used + s], fresh[used + s : used + s + g]
        used += s + g
        segment = np.concatenate([[n_random], sentence, gap, sentence])
        stream[at : at + len(segment)] = segment
        at += len(segment)
    return torch.from_numpy(stream[:total].reshape(rows, seq_len).copy())


NEEDS_BOS = "data.name=sentence_gap_copy needs data.bos=true (every segment starts with BOS)"


@dataclass
class SentenceGapCopy(Task):
    """Packed ``[BOS] s g s`` segments (the module docstring): sentences of ``U{min_sentence..max_sentence}``
    tokens, gaps of ``U{0..max_gap}``; 1000 sequences of 100 tokens a step, as seed 002's script."""

    name: str = "sentence_gap_copy"
    batch_size: int = 1000
    seq_len: int = 100
    min_sentence: int = 1
    max_sentence: int = 50
    max_gap: int = 50

    def problems(self, n_random: int, n_ctx: int) -> list[str]:
        problems = super().problems(n_random, n_ctx)
        if not self.bos:
            problems.append(NEEDS_BOS)
        if not 1 <= self.min_sentence <= self.max_sentence or self.max_gap < 0:
            problems.append(
                f"data.min_sentence={self.min_sentence}, data.max_sentence={self.max_sentence}, data.max_gap={self.max_gap}:"
                " need 1 <= min_sentence <= max_sentence and max_gap >= 0"
            )
        return problems

    def sampler(self, n_random: int) -> TokenSampler:
        if not self.bos:
            raise ValueError(NEEDS_BOS)
        return lambda ids: sentence_gap_tokens(
            self.seed, ids, self.seq_len, n_random, self.max_sentence, self.max_gap, self.min_sentence
        )
