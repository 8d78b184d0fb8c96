"""K-only mean-ablation on the hand-built circuit, where the answer is known."""

from __future__ import annotations

import torch

from data.probe import ProbeBatch
from metrics.ablation import key_ablation_effects
from tests.hand_built import induction_circuit_model

TOKENS = torch.tensor([[8, 0, 1, 2, 3, 0, 1, 2, 3], [8, 5, 7, 6, 4, 5, 7, 6, 4], [8, 2, 6, 1, 7, 2, 6, 1, 7]])
PROBE = ProbeBatch(tokens=TOKENS, n=4, first_start=1)


def test_ablating_the_previous_token_head_from_the_induction_keys_breaks_induction():
    effects = key_ablation_effects(induction_circuit_model(), PROBE)
    # averaged over all 9 query rows, of which only the 4 repeated ones can move: at most ~4/9
    assert effects.pattern_change[0, 0, 1, 0] > 0.3
    assert effects.loss_change[0, 0, 1, 0] > 1.0  # and the repeated tokens become unpredictable
    # the K-composing pair is the one the ablation hurts most
    assert int(effects.loss_change.nan_to_num(-1.0).flatten().argmax()) == int(torch.tensor([0, 0, 1, 0]) @ torch.tensor([8, 4, 2, 1]))
    assert effects.pattern_change[0, 1, 1, 0] < 0.05  # the small random distractor barely matters
    assert effects.pattern_change[1, 0, 0, 0].isnan()  # masked: layer order


def test_a_head_that_writes_nothing_has_exactly_zero_effect():
    model = induction_circuit_model()
    with torch.no_grad():
        model.layers[0].W_O[1].zero_()  # L0H1 writes nothing: its mean equals its output
    effects = key_ablation_effects(model, PROBE)
    assert effects.pattern_change[0, 1, 1, 0] == 0 and effects.pattern_change[0, 1, 1, 1] == 0
    assert effects.loss_change[0, 1, 1, 0] == 0


def test_ablation_leaves_mode_and_weights_alone():
    model = induction_circuit_model().train()
    before = [p.clone() for p in model.parameters()]
    key_ablation_effects(model, PROBE)
    assert model.training
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_given_clean_run_gives_the_same_effects():
    model = induction_circuit_model().eval()
    with torch.no_grad():
        clean_run = model.run_with_cache(PROBE.tokens)
    given, fresh = key_ablation_effects(model, PROBE, clean_run), key_ablation_effects(model, PROBE)
    for name, values in given.effects().items():
        torch.testing.assert_close(values, fresh.effects()[name], equal_nan=True)
