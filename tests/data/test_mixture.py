"""The mixture task: a sample is a pure function of (seed, id), each component's share is its weight,
a sample of component c is c's own sample drawn with c's seed, the strategies are one component's own
on the mixture's sequences of it, every problem is named at once, and the config path takes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.tasks.markov_icl import MarkovICL
from data.tasks.mixture import Mixture, component_seed
from data.tasks.repeated import Repeated

N_RANDOM = 256  # the default model's task tokens (d_vocab 257 less BOS)


def chains(tokens: torch.Tensor, k: int = 2) -> torch.Tensor:
    """``[b]``: the rows whose tokens after BOS are all chain states ``< k``."""
    return (tokens[:, 1:] < k).all(1)


def periodic(tokens: torch.Tensor, n_min: int = 8, n_max: int = 16) -> torch.Tensor:
    """``[b]``: the rows whose tokens after BOS repeat with a period in ``[n_min, n_max]``."""
    body = tokens[:, 1:]
    return torch.stack([(body[:, n:] == body[:, :-n]).all(1) for n in range(n_min, n_max + 1)]).any(0)


def own_sample(task, ids: np.ndarray, vocab: int = N_RANDOM) -> torch.Tensor:
    """``task``'s own sampler on ``vocab`` tokens, its BOS (id ``vocab``) written as id ``N_RANDOM``."""
    tokens = task.sampler(vocab)(ids)
    return torch.where(tokens == vocab, N_RANDOM, tokens)


def test_a_sample_is_a_pure_function_of_seed_and_id_in_any_batch():
    draw = Mixture(seed=4).sampler(N_RANDOM)
    ids = np.arange(1000, 1064)
    batch = draw(ids)
    order = np.random.default_rng(0).permutation(len(ids))
    assert torch.equal(draw(ids[order]), batch[order])  # shuffled
    assert torch.equal(torch.cat([draw(ids[:5]), draw(ids[5:])]), batch)  # split
    assert torch.equal(draw(ids[[17]])[0], batch[17])  # alone
    assert not torch.equal(Mixture(seed=5).sampler(N_RANDOM)(ids), batch)
    assert batch.shape == (64, 33) and (batch[:, 0] == N_RANDOM).all() and (batch[:, 1:] < N_RANDOM).all()


def test_each_component_s_share_of_the_samples_is_its_weight():
    """Components read from the tokens alone: chains use states 0 and 1 only (a chain may also be
    periodic), repeated tokens are periodic, bigram-trigger rows neither. Over N = 6000 ids each share
    is within 5 binomial standard deviations ``5 sqrt(w (1 - w) / N)`` of its normalised weight w
    (0.0258 for w = 1/2)."""
    mixture = Mixture(seed=1, components={"repeated": 1.0, "markov_icl": 1.5, "bigram_triggers": 2.5})
    tokens = mixture.sampler(N_RANDOM)(np.arange(6000))
    is_chain = chains(tokens)
    is_repeated = periodic(tokens) & ~is_chain
    shares = {
        "repeated": is_repeated.double().mean().item(),
        "markov_icl": is_chain.double().mean().item(),
        "bigram_triggers": (~is_chain & ~is_repeated).double().mean().item(),
    }
    for name, weight in {"repeated": 0.2, "markov_icl": 0.3, "bigram_triggers": 0.5}.items():
        assert abs(shares[name] - weight) < 5 * np.sqrt(weight * (1 - weight) / len(tokens)), shares


def test_a_sample_of_a_component_is_that_component_s_own_sample_with_its_seed():
    """Each row is, token for token, the sample its id gives in the component task built by hand (the
    mixture's length and BOS, the component's options and vocabulary, the seed component_seed), and
    not the other component's."""
    mixture = Mixture(seed=2, vocab={"markov_icl": 3}, options={"markov_icl": {"k": 3, "alpha": 0.5}})
    ids = np.arange(500, 564)
    tokens = mixture.sampler(N_RANDOM)(ids)
    repeated = own_sample(Repeated(seed=component_seed(2, "repeated")), ids)
    markov = own_sample(MarkovICL(seed=component_seed(2, "markov_icl"), seq_len=33, bos=True, k=3, alpha=0.5), ids, 3)
    is_repeated, is_markov = (tokens == repeated).all(1), (tokens == markov).all(1)
    assert (is_repeated ^ is_markov).all()  # every row is one component's own, never both
    assert 10 < is_markov.sum() < 54  # both drawn (each w = 1/2 of 64: 5 sd is ±20)
    assert torch.equal(is_markov, chains(tokens, 3))


def test_one_component_of_weight_one_is_that_task_with_the_component_seed():
    """``components={repeated: 1}`` draws ``data=repeated`` with ``data.seed=component_seed(seed,
    'repeated')``, batch for batch, and its strategies are that task's on the same ids; not the
    repeated task with the mixture's own seed (a component's stream is its own)."""
    mixture = Mixture(seed=7, components={"repeated": 1.0})
    alone = Repeated(seed=component_seed(7, "repeated"))
    for first in (0, 32, 10**12):
        ids = np.arange(first, first + 32)
        assert torch.equal(mixture.sampler(N_RANDOM)(ids), alone.sampler(N_RANDOM)(ids))
    assert not torch.equal(mixture.sampler(N_RANDOM)(ids), Repeated(seed=7).sampler(N_RANDOM)(ids))
    ours, theirs = mixture.reference(ids, N_RANDOM), alone.reference(ids, N_RANDOM)
    assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.positions, theirs.positions)
    assert ours.strategies.keys() == theirs.strategies.keys() == {"uniform", "copy", "induction"}
    assert all(torch.equal(ours.strategies[s], theirs.strategies[s]) for s in ours.strategies)
    seeds = {component_seed(7, name) for name in ("repeated", "markov_icl", "bigram_triggers")}
    assert len(seeds) == 3 and 7 not in seeds


def test_the_strategies_are_one_component_s_own_on_the_mixture_s_sequences_of_it():
    """``strategies_of=markov_icl``: the first 16 chains of the mixture's stream from the first id on
    (found by their tokens), and the chain task's own strategies and truth on them, padded with 0 for
    the 254 tokens a chain does not use; the default is the heaviest component, the first of equals."""
    mixture = Mixture(seed=3, strategies_of="markov_icl")
    first = 2 * 10**12
    reference = mixture.reference(np.arange(first, first + 16), N_RANDOM)
    stream = mixture.sampler(N_RANDOM)(np.arange(first, first + 64))
    ids = first + np.flatnonzero(chains(stream))[:16]
    assert torch.equal(reference.tokens, stream[ids - first])
    own = MarkovICL(seed=component_seed(3, "markov_icl"), seq_len=33, bos=True).reference(ids, 2)
    assert reference.positions.tolist() == [31] and reference.strategies.keys() == {"uniform", "unigram", "bigram"}
    for name, q in own.strategies.items():
        assert torch.equal(reference.strategies[name], F.pad(q, (0, N_RANDOM - 2)))
    assert torch.equal(reference.truth, F.pad(own.truth, (0, N_RANDOM - 2)))
    assert torch.allclose(reference.truth.sum(-1), torch.ones(16, 1, dtype=torch.float64))
    assert Mixture().strategies_component() == "repeated"
    assert Mixture(components={"repeated": 0.4, "markov_icl": 0.6}).strategies_component() == "markov_icl"


KNOWN = "choose among bigram_triggers, markov_icl, repeated, sentence_gap_copy"


@pytest.mark.parametrize(
    "options, expected",
    [
        (
            dict(
                components={"nope": 1.0, "mixture": 1.0, "repeated": -1.0, "markov_icl": 1.0, "sentence_gap_copy": 0.0},
                options={"repeated": {"n_min": 40, "seq_len": 50}, "markov_icl": {"k": 3}, "bigram_trigers": {}},
                vocab={"markov_icl": 2},
            ),
            [
                f"data.components.nope: no such task; {KNOWN}",
                f"data.components.mixture: a mixture cannot hold a mixture ({KNOWN})",
                "data.components.repeated=-1.0: a weight must be a finite number >= 0",
                f"data.options.bigram_trigers: no such task to mix; {KNOWN}",
                "data.options.repeated.seq_len: set by the mixture for every component (data.seq_len)",
                "data.components.markov_icl (on data.vocab.markov_icl=2 task tokens: its model.d_vocab=3):"
                " data.options.markov_icl.k=3 needs model.d_vocab=4 (the k states and BOS; experiment=markov_icl"
                " sets it), got 3",
                "data.components.sentence_gap_copy: a packed task (its rows are one stream over the batch) cannot be"
                " mixed: the mixture draws each sample by its own id, apart from the rest of the batch",
            ],
        ),
        (
            dict(components={"repeated": 0.0, "markov_icl": 0.0}, options={"repeated": {"n_min": 20, "tokens": 3}}),
            [
                "data.components={'repeated': 0.0, 'markov_icl': 0.0}: every weight is 0; give at least one a weight > 0",
                "data.options.repeated.tokens: not an option of repeated (its options: n_min, n_max, block)",
            ],
        ),
        (
            dict(
                options={"repeated": {"n_min": 20}, "markov_icl": {"alpha": "high"}},
                vocab={"markov_icl": 300},
                strategies_of="bigram_triggers",
            ),
            [
                "data.vocab.markov_icl=300 must be a whole number of task tokens in [1, 256] (model.d_vocab=257 less BOS)",
                "data.strategies_of=bigram_triggers: not a component (data.components has repeated, markov_icl)",
                "data.components.repeated: data.options.repeated.n_min=20, data.options.repeated.n_max=16:"
                " need 1 <= n_min <= n_max",
                "data.options.markov_icl.alpha='high' must be a number",
            ],
        ),
    ],
    ids=["names-weights-components", "all-zero", "vocab-types-strategies"],
)
def test_bad_options_give_every_problem_at_once(options, expected):
    assert Mixture(**options).problems(N_RANDOM, 33) == expected


def test_the_mixture_s_own_problems_are_not_repeated_by_each_component():
    assert Mixture(seq_len=40).problems(N_RANDOM, 33) == ["data.seq_len=40 exceeds model.n_ctx=33"]
    assert Mixture().problems(N_RANDOM, 33) == []


def test_data_mixture_composes_validates_and_builds_its_component_options():
    from conf.objects import task_of
    from conf.validate import config_problems
    from tests.helpers import composed

    cfg = composed("data=mixture", "seed=6", "+data.options.markov_icl.alpha=0.5", "~data.components.repeated")
    assert config_problems(cfg) == []
    task = task_of(cfg)
    assert task == Mixture(seed=6, components={"markov_icl": 0.5}, options={"markov_icl": {"alpha": 0.5}})
    ids = np.arange(8)
    alone = MarkovICL(seed=component_seed(6, "markov_icl"), seq_len=33, bos=True, alpha=0.5)
    assert torch.equal(task.sampler(N_RANDOM)(ids), own_sample(alone, ids, 2))
    problems = config_problems(composed("data=mixture", "+data.components.nope=0.5"))
    assert problems == [f"data.components.nope: no such task; {KNOWN}"]


def test_train_py_refuses_a_bad_component_in_one_line_before_anything_is_created(tmp_path):
    from tests.helpers import run_refused

    result = run_refused(["data=mixture", "+data.components.sentence_gap_copy=0.5"], tmp_path / "run")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "data.components.sentence_gap_copy: a packed task" in lines[0]
    assert not (tmp_path / "run").exists() and not list(tmp_path.rglob("wandb"))
