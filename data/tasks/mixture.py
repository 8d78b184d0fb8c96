"""A mixture of tasks: each sequence is drawn from one of several other tasks, with given weights, so
that one model trained on it develops the heads of each (Wang, Farrugia-Roberts, Hoogland, Carroll,
Wei and Murfet 2024, "Differentiation and specialization of attention heads via the refined local
learning coefficient", train a two-layer attention-only model on a mixture of data to get several
kinds of head at once).

The default mixes repeated random tokens (Olsson et al. 2022, "In-context Learning and Induction
Heads": previous-token and induction heads) and in-context Markov chains over 2 states (Edelman et al.
2024, "The Evolution of Statistical Induction Heads": previous-token and statistical induction heads,
in-context unigram then bigram) half and half: the two two-layer circuits the tracker reads, which
share the previous-token head, in one model.

Sample id ``i`` goes to component ``c`` by a uniform draw of ``(seed, i)`` on a stream of its own
against the weights' cumulative shares; ``c``'s own sampler then draws sample ``i`` with
:func:`component_seed` ``(seed, c)``. A sample is a pure function of ``(seed, i)`` (and the options),
whatever batch it is drawn in. A packed task (its rows depend on the batch: ``sentence_gap_copy``)
cannot be a component: :meth:`Mixture.problems` says so.

Every component shares the vocabulary: task tokens ``0 .. n_random - 1``, BOS ``n_random``. A
component named in ``vocab`` draws on its first ``vocab[c]`` task tokens only (a chain's ``k`` states:
``markov_icl`` checks ``k`` against them as it would against the model's ``d_vocab``), its BOS
(id ``vocab[c]``) written as the mixture's.
"""

from __future__ import annotations

import math
import typing
import zlib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from data import reference_predictors
from data.counter_rng import random_bits, random_uniform
from data.task import Task, TokenSampler, tasks

COMPONENT_STREAM, SEED_STREAM = 0x4D49, 0x4D4A  # the mixture's own streams ("MI", "MJ"): none of a component's

PASSED_DOWN = ("seed", "batch_size", "seq_len", "bos")
"""The mixture's options every component takes (``seed`` as :func:`component_seed`), not set per component."""


def component_seed(seed: int, name: str) -> int:
    """The seed component ``name`` draws its samples with in a mixture of ``seed``: 63 counter-based
    bits of ``(seed, crc32(name))`` on the mixture's seed stream (a component's seed does not change
    when another is added)."""
    key = np.array([zlib.crc32(name.encode())], dtype=np.uint64)
    return int(random_bits(seed, key, 1, SEED_STREAM)[0, 0] >> np.uint64(1))


def component_of(seed: int, sample_ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The component index ``(b,)`` of each sample id: a uniform draw of ``(seed, id)`` against the
    cumulative shares of ``weights [C]`` (a component of weight 0 is never drawn)."""
    edges = np.cumsum(weights) / weights.sum()
    u = random_uniform(seed, sample_ids, 1, COMPONENT_STREAM)[:, 0]
    return np.minimum(np.searchsorted(edges, u, side="right"), np.flatnonzero(weights > 0)[-1])


def embedded(tokens: Tensor, vocab: int, n_random: int, bos: bool) -> Tensor:
    """A component's ``tokens [b, seq_len]`` drawn on ``vocab`` task tokens, with its BOS (id ``vocab``)
    written as the mixture's (id ``n_random``)."""
    if not bos or vocab == n_random:
        return tokens
    return torch.where(tokens == vocab, n_random, tokens)


def rows_depend_on_batch(draw: TokenSampler, rows: int = 16) -> bool:
    """Whether ``draw`` gives samples ``1 .. rows - 1`` other tokens when drawn after sample 0 than
    without it: a packed task's rows are one stream over the batch (:meth:`data.task.Task.sampler`)."""
    return not torch.equal(draw(np.arange(rows))[1:], draw(np.arange(1, rows)))


def padded(predictions: Tensor, n_random: int) -> Tensor:
    """Distributions ``[b, p, vocab]`` over a component's tokens as ``[b, p, n_random]``: 0 on the rest."""
    return F.pad(predictions, (0, n_random - predictions.shape[-1]))


def valid_weight(weight: Any) -> bool:
    """Whether ``weight`` is a finite number ``>= 0``."""
    return isinstance(weight, int | float) and not isinstance(weight, bool) and math.isfinite(weight) and weight >= 0


OPTION_TYPES = {int: ((int,), "a whole number"), float: ((int, float), "a number"), bool: ((bool,), "true or false")}
OPTION_TYPES[str] = ((str,), "a string")
"""A component option's plain type -> the values it takes and their name (other types are not checked)."""


def type_problem(key: str, value: Any, hint: Any) -> str | None:
    """Why ``value`` cannot be a component's option typed ``hint`` (None where it can, or where the
    type is not one of :data:`OPTION_TYPES`)."""
    if hint not in OPTION_TYPES:
        return None
    accepted, said = OPTION_TYPES[hint]
    if isinstance(value, accepted) and (hint is bool or not isinstance(value, bool)):
        return None
    return f"{key}={value!r} must be {said}"


@dataclass
class Mixture(Task):
    """Each sample from one of ``components`` (task name -> weight, normalised), drawn by the sample id
    (the module docstring). ``vocab``: a component's task tokens where fewer than the model's (the
    default: 256 random tokens with the default model, a chain's 2 states); ``options``: a component's
    own options (``seed``, ``batch_size``, ``seq_len`` and ``bos`` are the mixture's, the default's 33
    tokens a chain of 32 after BOS); ``strategies_of``: the component whose strategies the
    ``strategies`` quantity reads (:meth:`reference`; None: the heaviest, the first listed of equals).

    On the command line these are Hydra dicts: ``data.components.markov_icl=0.2`` sets a weight,
    ``+data.components.bigram_triggers=0.3`` adds a component, ``~data.components.repeated`` removes
    one, ``+data.options.markov_icl.alpha=0.5`` sets a component's option; an entry of ``vocab`` or
    ``options`` for a task that is not a component is left unused."""

    name: str = "mixture"
    components: dict[str, float] = field(default_factory=lambda: {"repeated": 0.5, "markov_icl": 0.5})
    vocab: dict[str, int] = field(default_factory=lambda: {"markov_icl": 2})
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    strategies_of: str | None = None

    def component(self, name: str) -> Task:
        """Component ``name`` as a task of its own: its options, the mixture's passed down, its seed
        :func:`component_seed`."""
        passed = {key: getattr(self, key) for key in PASSED_DOWN}
        return tasks()[name](
            **{**passed, **dict(self.options.get(name) or {}), "seed": component_seed(self.seed, name)}
        )

    def vocab_of(self, name: str, n_random: int) -> int:
        """The task tokens component ``name`` draws on."""
        return int(self.vocab.get(name, n_random))

    def vocab_fits(self, name: str, n_random: int) -> bool:
        """Whether component ``name``'s task tokens are a whole number in ``[1, n_random]``."""
        vocab = self.vocab.get(name, n_random)
        return isinstance(vocab, int) and not isinstance(vocab, bool) and 1 <= vocab <= n_random

    def component_sequences(self, name: str, sample_ids: np.ndarray, n_random: int) -> Tensor:
        """Component ``name``'s sequences for ``sample_ids`` ``[b, seq_len]``, in the mixture's vocabulary
        (its tokens embedded as the mixture embeds them): one part of the training distribution alone,
        e.g. the loss of a data-refined LLC."""
        vocab = self.vocab_of(name, n_random)
        return embedded(self.component(name).sampler(vocab)(np.asarray(sample_ids)), vocab, n_random, self.bos)

    def weights(self) -> np.ndarray:
        """The components' weights ``[C]``, in ``components``' order."""
        return np.array([float(w) for w in self.components.values()])

    def strategies_component(self) -> str:
        """The component named by ``strategies_of``, or the heaviest (the first listed of equals)."""
        return self.strategies_of or max(self.components, key=lambda name: self.components[name])

    def problems(self, n_random: int, n_ctx: int) -> list[str]:
        """The mixture's own problems (its names, weights, vocabularies and options), then every
        component's own, prefixed ``data.components.NAME``, its option keys as ``data.options.NAME.KEY``."""
        problems = super().problems(n_random, n_ctx)
        known = {name: task for name, task in tasks().items() if not issubclass(task, Mixture)}
        choose = f"choose among {', '.join(known)}"
        if not self.components:
            problems.append(f"data.components is empty: name at least one task ({choose})")
        for name, weight in self.components.items():
            if name not in known:
                mixture = name in tasks()
                reason = f"a mixture cannot hold a mixture ({choose})" if mixture else f"no such task; {choose}"
                problems.append(f"data.components.{name}: {reason}")
            if not valid_weight(weight):
                problems.append(f"data.components.{name}={weight}: a weight must be a finite number >= 0")
        weights_ok = all(valid_weight(w) for w in self.components.values())
        drawn_any = weights_ok and sum(self.components.values()) > 0
        if self.components and weights_ok and not drawn_any:
            problems.append(
                f"data.components={dict(self.components)}: every weight is 0; give at least one a weight > 0"
            )
        for key, entries in (("vocab", self.vocab), ("options", self.options)):
            problems += [f"data.{key}.{name}: no such task to mix; {choose}" for name in entries if name not in known]
        for name, vocab in self.vocab.items():
            if not self.vocab_fits(name, n_random):
                problems.append(
                    f"data.vocab.{name}={vocab} must be a whole number of task tokens in [1, {n_random}]"
                    f" (model.d_vocab={n_random + int(self.bos)}{' less BOS' if self.bos else ''})"
                )
        strategies_of = self.strategies_component() if drawn_any else None
        if self.strategies_of is not None and self.strategies_of not in self.components:
            problems.append(
                f"data.strategies_of={self.strategies_of}: not a component (data.components has"
                f" {', '.join(self.components) or 'none'})"
            )
        elif strategies_of is not None and not self.components[strategies_of] > 0:
            problems.append(f"data.strategies_of={strategies_of}: its weight is 0, so no sequence of it is drawn")
        for name in self.components:
            if name in known:
                problems += self.component_problems(name, known[name], n_random, n_ctx)
        return problems

    def component_problems(self, name: str, task: type[Task], n_random: int, n_ctx: int) -> list[str]:
        """Component ``name``'s problems: its options' keys and types, its own :meth:`~data.task.Task.problems`
        (less the ones the mixture's own options give it), and whether it is packed."""
        options = dict(self.options.get(name) or {})
        hints = typing.get_type_hints(task)
        own = [f.name for f in fields(task) if f.init and f.name not in ("name", *PASSED_DOWN)]
        where = f"data.options.{name}"
        problems = [
            f"{where}.{key}: set by the mixture for every component (data.{key})"
            if key in PASSED_DOWN or key == "name"
            else f"{where}.{key}: not an option of {name} (its options: {', '.join(own) or 'none'})"
            for key in options
            if key not in own
        ]
        problems += [
            p for key in options if key in own if (p := type_problem(f"{where}.{key}", options[key], hints[key]))
        ]
        if problems or not self.vocab_fits(name, n_random):
            return problems
        component, vocab = self.component(name), self.vocab_of(name, n_random)
        inherited = set(Task.problems(component, vocab, n_ctx))
        prefix = f"data.components.{name}"
        if name in self.vocab:
            prefix += f" (on data.vocab.{name}={vocab} task tokens: its model.d_vocab={vocab + int(self.bos)})"
        found = [
            f"{prefix}: {self.option_keys(name, p)}" for p in component.problems(vocab, n_ctx) if p not in inherited
        ]
        if found or inherited:
            return found
        try:
            packed = rows_depend_on_batch(component.sampler(vocab))
        except Exception as error:  # a component's sampler failing on options its problems() let through
            return [f"{prefix}: its sampler fails on these options ({type(error).__name__}: {error})"]
        if packed:
            found.append(
                f"data.components.{name}: a packed task (its rows are one stream over the batch) cannot be mixed:"
                " the mixture draws each sample by its own id, apart from the rest of the batch"
            )
        return found

    def option_keys(self, name: str, problem: str) -> str:
        """``problem`` of component ``name`` with its own option keys written as the mixture's
        (``data.k`` -> ``data.options.markov_icl.k``)."""
        for f in fields(self.component(name)):
            if f.name not in ("name", *PASSED_DOWN):
                problem = problem.replace(f"data.{f.name}=", f"data.options.{name}.{f.name}=")
        return problem

    def sampler(self, n_random: int) -> TokenSampler:
        """Sample ids ``(b,)`` -> tokens ``[b, seq_len]``: each id's component (:func:`component_of`)
        draws it with its own sampler (its vocabulary embedded: :func:`embedded`)."""
        weights = self.weights()
        drawn = {}
        for index, name in enumerate(self.components):
            if weights[index] > 0:
                draw = self.component(name).sampler(self.vocab_of(name, n_random))
                if rows_depend_on_batch(draw):
                    raise ValueError(f"data.components.{name}: a packed task cannot be mixed")
                drawn[index] = (draw, self.vocab_of(name, n_random))

        def sample(sample_ids: np.ndarray) -> Tensor:
            sample_ids = np.asarray(sample_ids)
            which = component_of(self.seed, sample_ids, weights)  # (b,)
            tokens = torch.empty(len(sample_ids), self.seq_len, dtype=torch.long, device="cpu")
            for index, (draw, vocab) in drawn.items():
                rows = np.flatnonzero(which == index)
                if len(rows):
                    tokens[torch.from_numpy(rows)] = embedded(draw(sample_ids[rows]), vocab, n_random, self.bos)
            return tokens

        return sample

    def reference(self, sample_ids: np.ndarray, n_random: int) -> reference_predictors.ReferencePredictions:
        """The strategies of one component (``strategies_of``), on the mixture's sequences of it: the
        first ``len(sample_ids)`` ids from ``sample_ids[0]`` on that the mixture gives that component,
        with its reference's positions, scored mask and truth (its strategies and truth padded with 0
        for the task tokens it does not draw on). The components' strategies cannot be pooled into one
        set: each names its own (copy and induction; in-context unigram and bigram; a bigram learnt in
        the weights), every one defined against its own task's data (a chain's ``k`` states, the
        triggers of one chain) and scored where its data is predictable, so a strategy of one has no
        value on another's sequences; the generic strategies (:meth:`data.task.Task.reference`), at
        every position of every sequence, are none of a chain's and read repeated tokens where most
        next tokens are new. A component on
        fewer tokens than the model's gives its strategies no mass on the others, so the mixture
        reading's KL(model ‖ mixture) counts the model's mass there at ``-log 1e-300`` per unit
        (``strategies/mixture_kl`` is large until the model keeps to the chain's states); the KLs
        to each strategy and the weights are read as usual."""
        name = self.strategies_component()
        index, weights = list(self.components).index(name), self.weights()
        if not weights[index] > 0:
            raise ValueError(f"data.strategies_of={name}: its weight is 0, so no sequence of it is drawn")
        wanted, first, span = len(sample_ids), int(sample_ids[0]), len(sample_ids)
        while True:
            candidates = np.arange(first, first + span)
            ids = candidates[component_of(self.seed, candidates, weights) == index]
            if len(ids) >= wanted:
                break
            span *= 2
        ids, vocab = ids[:wanted], self.vocab_of(name, n_random)
        own = self.component(name).reference(ids, vocab)
        tokens = embedded(own.tokens, vocab, n_random, self.bos)
        if not torch.equal(tokens, self.sampler(n_random)(ids)):
            raise ValueError(
                f"data.strategies_of={name}: its reference draws sequences of its own, not the ids it is given"
            )
        return reference_predictors.ReferencePredictions(
            tokens,
            own.positions,
            {strategy: padded(q, n_random) for strategy, q in own.strategies.items()},
            truth=None if own.truth is None else padded(own.truth, n_random),
            scored=own.scored,
        )
