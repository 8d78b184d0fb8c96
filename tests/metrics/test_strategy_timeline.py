"""The mixture reading and the switch finder on synthetic inputs whose truth is known: models that output
a known mixture of the strategies; per-sequence KL timelines with no switch (noise; every KL moving
while their order holds, a change the strategies cannot see), one switch and two."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from bench.strategy_nulls import CASES, NAMES, STEPS, judge
from data.task import tasks
from data.tasks.markov_icl import MarkovICL
from metrics.dynamics.strategy_readings import mixture_weights, rise_steps, token_groups
from tests.helpers import REPO

MIXTURES = [
    (1 / 3, 1 / 3, 1 / 3),
    (0.9, 0.1, 0.0),
    (0.2, 0.3, 0.5),
    (0.0, 0.0, 1.0),
    (0.97, 0.03, 0.0),
    (1.0, 0.0, 0.0),
]


@pytest.mark.parametrize(
    "task, n_random", [(MarkovICL(k=3), 3), (tasks()["repeated"](), 64)], ids=["markov", "repeated"]
)
def test_mixture_weights_recover_a_known_mixture(task, n_random):
    reference = task.reference(np.arange(64), n_random)
    q = torch.stack(list(reference.strategies.values())).flatten(1, 2)  # (S, N, V)
    groups = token_groups(q)
    assert groups.profile.shape[1] <= 3  # uniform / context / the induction target: at most 3 kinds of token
    for weights in MIXTURES:
        model = torch.einsum("s,snv->nv", torch.tensor(weights, dtype=torch.float64), q)
        found, kl = mixture_weights(model, groups)
        assert np.abs(found - np.array(weights)).max() < 1e-5
        assert abs(kl) < 1e-10


def test_mixture_of_a_model_off_the_simplex_is_its_closest_projection():
    reference = MarkovICL(k=2).reference(np.arange(256), 2)
    q = torch.stack(list(reference.strategies.values())).flatten(1, 2)
    model = reference.truth.flatten(0, 1)  # the truth is no mixture of the three: KL > 0, weights on the simplex
    found, kl = mixture_weights(model, token_groups(q))
    assert kl > 0 and found.min() >= 0 and found.sum() == pytest.approx(1)
    grid = [(a, b, 1 - a - b) for a in np.linspace(0, 1, 41) for b in np.linspace(0, 1, 41) if a + b <= 1 + 1e-12]
    for w in grid:  # no grid point beats the solver
        mix = torch.einsum("s,snv->nv", torch.tensor(w, dtype=torch.float64), q)
        assert (model * (model.log() - mix.log())).sum(-1).mean().item() >= kl - 1e-9


@pytest.mark.parametrize("case", list(CASES))
def test_switches_are_found_where_the_closest_strategy_changes(case):
    crossings, order_change = CASES[case]
    rng = np.random.default_rng(0)
    results = [judge(rng, crossings, order_change, noise=0.05, resamples=50) for _ in range(20)]
    assert sum(right for right, _ in results) >= 19  # bench.strategy_nulls: the rates over 200 draws
    assert sum(covered for _, covered in results) >= 18


def test_rise_steps_mark_where_a_weight_first_holds_above_the_threshold():
    weights = np.zeros((len(STEPS), 3))
    weights[:, 0] = 1
    rising = np.clip((STEPS - 600) / 1000, 0, 1)
    weights[:, 1] = rising
    weights[:, 0] -= rising
    weights[50, 2] = 0.5  # one snapshot's blip: not a rise
    rises = rise_steps(STEPS, weights, NAMES)
    assert rises == {"unigram": 700.0}  # 0.1 first reached at step 700; uniform starts above it


def test_the_strategies_quantity_reads_only_a_task_s_scored_positions():
    """sentence_gap_copy's strategies count on the repeated sentences only: a model that is a known
    mixture of them there, and all on one token elsewhere, reads as that mixture, its KL to each strategy
    the mean over each row's repeats written out by hand."""
    from types import SimpleNamespace

    from metrics.tracked.strategies import Strategies

    n_random = 20
    reference = tasks()["sentence_gap_copy"](seq_len=40, max_sentence=8, max_gap=6).reference(np.arange(16), n_random)
    q = reference.strategies
    mixture = 0.3 * q["uniform"] + 0.7 * q["induction"]  # (b, p, V) at every position
    elsewhere = torch.full_like(mixture, 1e-6)
    elsewhere[..., 0] = 1.0
    probs = torch.where(reference.scored[..., None], mixture, elsewhere / elsewhere.sum(-1, keepdim=True))
    logits = torch.full((*reference.tokens.shape, n_random + 1), -1e4, dtype=torch.float64)  # BOS never predicted
    logits[:, reference.positions, :n_random] = probs.log()

    def model(tokens):
        assert torch.equal(tokens, reference.tokens)
        return logits

    quantity = Strategies().use(reference, n_random)
    reading = quantity.measure(SimpleNamespace(model=model, logits=logits))
    assert np.abs(reading.weights - np.array([0.3, 0.0, 0.7])).max() < 1e-5 and abs(reading.mixture_kl) < 1e-10
    for name in ("uniform", "copy", "induction"):
        by_hand = []
        for row in range(len(reference.tokens)):
            kls = []
            for j in reference.scored[row].nonzero()[:, 0].tolist():
                strategy, model_row = q[name][row, j], probs[row, j]
                kls.append(sum(float(s * (s.log() - m.log())) for s, m in zip(strategy, model_row) if s > 0))
            by_hand.append(sum(kls) / len(kls))
        assert reading.kl[name] == pytest.approx(by_hand, rel=1e-9)
    assert reading.closest == 2  # induction: closer than uniform on the repeats
    every = Strategies().use(type(reference)(reference.tokens, reference.positions, q), n_random)
    unscored = every.measure(SimpleNamespace(model=model, logits=logits))
    assert np.abs(unscored.weights - np.array([0.3, 0.0, 0.7])).max() > 0.1  # the other positions would count


@pytest.mark.parametrize("name", sorted(tasks()))
def test_the_tracked_reading_equals_the_dense_kls_and_mixture_on_every_task(name):
    """The tracker's grouped reading (two sums over token groups) against the dense one: every
    strategy's and the truth's KL over the whole vocabulary, the mixture over groups of the strategies
    alone, on a random model's predictions."""
    from types import SimpleNamespace

    from conf.objects import n_random, task_of
    from data.reference_predictors import scored_mean
    from metrics.dynamics.strategy_readings import kl_rows, safe_log, strategy_kls
    from metrics.tracked.strategies import Strategies
    from tests.helpers import composed

    config = composed("experiment=markov_icl" if name == "markov_icl" else f"data={name}")  # its model fits its states
    reading = Strategies().for_task(task_of(config), n_random(config))
    vocabulary = reading.n_random
    reference = reading.reference
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(*reference.tokens.shape, vocabulary + 1, generator=generator, dtype=torch.float64)
    model = SimpleNamespace(model=lambda tokens: logits, logits=logits)
    found = reading.measure(model)
    log_model = logits[:, reference.positions].log_softmax(-1)[..., :vocabulary]
    dense = strategy_kls(reference.strategies, log_model, reference.scored)
    for strategy in reference.strategies:
        np.testing.assert_allclose(found.kl[strategy], dense[strategy].numpy(), rtol=1e-12, atol=1e-12)
    if reference.truth is not None:
        truth = scored_mean(kl_rows(reference.truth, safe_log(reference.truth), log_model), reference.scored)
        np.testing.assert_allclose(found.truth_kl, truth.numpy(), rtol=1e-12, atol=1e-12)
    scored = torch.ones(log_model.shape[:2], dtype=torch.bool) if reference.scored is None else reference.scored
    on_tokens = log_model.softmax(-1)[scored]
    stacked = torch.stack(list(reference.strategies.values()))[:, scored]
    weights, kl = mixture_weights(on_tokens, token_groups(stacked))
    np.testing.assert_allclose(found.weights, weights, atol=1e-6)
    assert found.mixture_kl == pytest.approx(kl, abs=1e-10)


BUILT_TRACKERS = """
import sys
from hydra import compose, initialize_config_dir
from conf.objects import build_quantities
from conf.schema import register_schemas
register_schemas()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    for overrides in (["tracker.strategies.every_n_steps=0"], []):
        cfg = compose("config", overrides=overrides)
        names = [q.name for q in build_quantities(cfg.tracker, cfg)]
        print("strategies" in names, "scipy.optimize" in sys.modules)
"""


def test_a_tracker_that_reads_strategies_loads_the_solver_when_it_is_built():
    """SciPy's optimizer is imported with the tracker (while W&B opens), not in the first snapshot, whose
    cost the run's cost report reads (it printed "strategies 389 ms every 20 ... expected tracker overhead
    86 %" for the default run); a tracker without strategies, built first in the same fresh interpreter,
    imports none of it."""
    command = [sys.executable, "-c", BUILT_TRACKERS, str(REPO / "conf")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "False", "True", "True"]
