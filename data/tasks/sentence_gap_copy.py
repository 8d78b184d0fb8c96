"""Sentence, gap, sentence again: the copying data of aslvrstn 2022 (aslvrstn, "Composition Measures
in Transformers", 2022; its training script ``composition/train_tiny_attn_only.py`` in the
``aslvrstn/mlscratchpad`` repository).

A segment is ``[BOS] s g s``: a "sentence" ``s`` of ``U{min_sentence..max_sentence}`` uniform random tokens,
a "gap" ``g`` of ``U{0..max_gap}`` uniform random tokens, then the sentence again. Segments are
packed back to back over the flattened batch, so a segment may straddle two rows (and a row need
not start with BOS), as in that script. Predicting the second copy of a sentence needs an
induction circuit; nothing else in the stream is predictable, so the strategies (:meth:`SentenceGapCopy.reference`)
are scored there only.

The script's ids are BOS = 0 and tokens 1..999; here, as in every generator of this project, random
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

from data import reference_predictors
from data.counter_rng import random_ints
from data.task import Task, TokenSampler

TOKEN_STREAM, SENTENCE_STREAM, GAP_STREAM, TAIL_STREAM = 0, 1, 2, 3

MORE_ROWS = 64
"""The strategies' held-out rows are drawn from a stream up to this many times as long as asked, for
rows that hold a repeat to score (:meth:`SentenceGapCopy.reference`)."""


@dataclass(frozen=True)
class Packed:
    """A packed stream read row by row: ``tokens [rows, seq_len]`` and ``copied_from [rows, seq_len]``,
    for each token of a second copy the flat index (``row · seq_len + position``) of the first copy's
    token it repeats, -1 for BOS, sentence and gap tokens."""

    tokens: Tensor
    copied_from: Tensor


def sentence_gap_packed(
    seed: int,
    sample_ids: np.ndarray,
    seq_len: int,
    n_random: int,
    max_sentence: int = 50,
    max_gap: int = 50,
    min_sentence: int = 1,
) -> Packed:
    """Packed ``[BOS] s g s`` segments over ``len(sample_ids)`` rows of ``seq_len`` tokens, and where
    each second copy's tokens were copied from (:class:`Packed`).

    aslvrstn 2022's script copies ``sent_len + 1`` tokens for ``sent_len ~ U{1..50}``: its sentences
    are ``min_sentence=2, max_sentence=51`` here."""
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
    fresh = np.concatenate(  # consumed in order: each s once, each g; the last segment may reach past `total`
        [
            random_ints(seed, key, total, n_random, TOKEN_STREAM)[0],
            random_ints(seed, key, max_sentence + max_gap, n_random, TAIL_STREAM)[0],
        ]
    )
    stream = np.empty(total + 3 * (max_sentence + max_gap + 1), dtype=np.int64)
    copied_from = np.full(len(stream), -1, dtype=np.int64)
    at = used = 0
    for s, g in zip(sentences, gaps):
        if at >= total:
            break
        sentence, gap = fresh[used : used + s], fresh[used + s : used + s + g]
        used += s + g
        segment = np.concatenate([[n_random], sentence, gap, sentence])
        stream[at : at + len(segment)] = segment
        copied_from[at + 1 + s + g : at + len(segment)] = np.arange(at + 1, at + 1 + s)
        at += len(segment)
    return Packed(
        torch.from_numpy(stream[:total].reshape(rows, seq_len).copy()),
        torch.from_numpy(copied_from[:total].reshape(rows, seq_len).copy()),
    )


def sentence_gap_tokens(
    seed: int,
    sample_ids: np.ndarray,
    seq_len: int,
    n_random: int,
    max_sentence: int = 50,
    max_gap: int = 50,
    min_sentence: int = 1,
) -> Tensor:
    """Token ids ``[len(sample_ids), seq_len]``: packed ``[BOS] s g s`` segments, read row by row
    (:func:`sentence_gap_packed`'s tokens)."""
    return sentence_gap_packed(seed, sample_ids, seq_len, n_random, max_sentence, max_gap, min_sentence).tokens


def repeat_positions(copied_from: Tensor) -> Tensor:
    """``[rows, seq_len - 1]`` booleans: the positions (of the model's logits) whose next token an
    induction circuit can predict from inside the row: a second copy's token from its second on, whose
    first copy's previous token lies in the same row (``copied_from`` of :class:`Packed`). Nothing
    recalls the first token of a second copy (it follows a gap token), nor a token whose first copy
    began in the row before; nothing else in the stream is predictable."""
    rows, seq_len = copied_from.shape
    row_start = (torch.arange(rows, device="cpu") * seq_len)[:, None]
    source, previous = copied_from[:, 1:], copied_from[:, :-1]  # position j predicts token j + 1
    return (source >= 0) & (previous >= 0) & (source - 1 >= row_start)


NEEDS_BOS = "data.name=sentence_gap_copy needs data.bos=true (every segment starts with BOS)"


@dataclass
class SentenceGapCopy(Task):
    """Packed ``[BOS] s g s`` segments (the module docstring): sentences of ``U{min_sentence..max_sentence}``
    tokens, gaps of ``U{0..max_gap}``; 1000 sequences of 100 tokens a step, as aslvrstn 2022's script."""

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

    def scored_rows(self, sample_ids: np.ndarray, n_random: int) -> tuple[Packed, Tensor, Tensor]:
        """The held-out stream the strategies read (:meth:`reference`): its packing, the positions to score
        ``[rows, seq_len - 1]`` and the first ``len(sample_ids)`` rows that hold one; ValueError (one line)
        where :data:`MORE_ROWS` times as many rows hold too few."""
        if not self.bos:
            raise ValueError(NEEDS_BOS)
        wanted, first = len(sample_ids), int(sample_ids[0])
        drawn = wanted
        while True:
            packed = sentence_gap_packed(
                self.seed,
                np.arange(first, first + drawn),
                self.seq_len,
                n_random,
                self.max_sentence,
                self.max_gap,
                self.min_sentence,
            )
            scored = repeat_positions(packed.copied_from)
            rows = scored.any(1).nonzero()[:, 0]
            if len(rows) >= wanted:
                return packed, scored, rows[:wanted]
            if drawn >= MORE_ROWS * wanted:
                raise ValueError(
                    f"data.seq_len={self.seq_len}, data.max_sentence={self.max_sentence}: {len(rows)} of {drawn}"
                    " held-out rows hold a repeated sentence's second token, too few for the strategies"
                    f" (tracker.strategies.sequences={wanted}; tracker.strategies.every_n_steps=0 turns them off)"
                )
            drawn *= 2

    def strategy_problems(self, sample_ids: np.ndarray, n_random: int) -> list[str]:
        try:
            self.scored_rows(sample_ids, n_random)
        except ValueError as error:
            return [str(error)]
        return []

    def reference(self, sample_ids: np.ndarray, n_random: int) -> reference_predictors.ReferencePredictions:
        """Uniform, copy (as :meth:`Task.reference`) and induction on the longest match
        (:func:`data.reference_predictors.longest_match`), scored on the repeated sentences only
        (:func:`repeat_positions`): elsewhere the next token is fresh and no strategy but uniform can
        know it, and the strategies would tell nothing of the phase change. Induction recalls the token
        after the earlier occurrence of the longest suffix of the context: the sentence's first copy.
        The latest earlier occurrence of the current token alone (:func:`data.reference_predictors.induction`) is
        a chance one, in the gap or the copy so far, at 39 % of these positions (64 held-out rows of
        ``experiment=aslvrstn_2022_cpu``'s data), where it names a token the data does not repeat.
        The rows are the first
        ``len(sample_ids)`` that hold a position to score, of the held-out stream of ``len(sample_ids)``
        rows (a pure function of the seed and ``sample_ids[0]``), else of the stream twice as long, ...
        up to :data:`MORE_ROWS` times (a row inside one long gap holds none). No truth: where a second
        copy starts is not known from the context alone."""
        packed, scored, rows = self.scored_rows(sample_ids, n_random)
        tokens, scored = packed.tokens[rows], scored[rows]
        positions = torch.arange(tokens.shape[1] - 1, device="cpu")
        predicted = {
            "uniform": reference_predictors.uniform(tokens, n_random),
            "copy": reference_predictors.copy(tokens, n_random),
            "induction": reference_predictors.longest_match(tokens, n_random),
        }
        return reference_predictors.ReferencePredictions(
            tokens, positions, reference_predictors.at_positions(predicted, positions), scored=scored
        )
