"""One forward pass: the ablation ground truth and the attribution read queries, keys, values and
patterns from the model's own forward (``run_with_cache``), on a model with every option that
changes it (shortformer positions, biases, LayerNorm) and a training-time intervention active."""

from __future__ import annotations

import subprocess

import pytest
import torch

from data.probe import make_probe_batch
from metrics.ground_truth import ablation
from metrics.ground_truth.ablation import key_ablation_effects
from metrics.ground_truth.attribution import key_attribution_effects
from models.attention import causal_pattern
from models.interventions import HeadChange
from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import REPO


def intervened_model(normalization: str) -> AttentionOnlyTransformer:
    """Three layers of three heads, shortformer positions and biases drawn away from 0, float64,
    with L0H1 clamped 70 % of the way to a previous-token pattern."""
    torch.manual_seed(0)
    shape = TransformerShape(3, 3, 24, 5, 17, 11, normalization, "shortformer", True)
    model = AttentionOnlyTransformer(shape).double().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b_"):
                parameter.normal_(0, 0.3)
    model.set_changes({0: [HeadChange(1, "clamp", "prev_token", strength=0.7)]})
    return model


PROBE = make_probe_batch(0, 6, 8, 10)


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_the_ablations_clean_pass_is_the_models_forward(normalization):
    """What the ablation reads of the clean run is run_with_cache's, bit for bit; the reader patterns
    it recomputes from those queries and keys are the forward pass's; the layers after a reader, run
    from the clean stream at the scored rows only, give its logits to float64 rounding."""
    model = intervened_model(normalization)
    with torch.inference_mode():
        logits, cache = model.run_with_cache(PROBE.tokens)
        clean = ablation._CleanRun.of(model, (logits, cache))
        for name in ("q", "k", "v"):
            assert all(torch.equal(mine, cache[name][l]) for l, mine in enumerate(getattr(clean, name)) if l)
        assert all(
            torch.equal(mine, theirs) for mine, theirs in zip(clean.stream, [*cache["resid_pre"], cache["resid_final"]])
        )
        for l2 in (1, 2):
            assert torch.equal(causal_pattern(cache["q"][l2], cache["k"][l2]), cache["pattern"][l2])
        scored = slice(PROBE.repeat_start, PROBE.repeat_start + PROBE.n - 1)
        after = model.run_layers(2, cache["resid_pre"][2], scored, tuple(cache[n][2] for n in "qkv"))
        torch.testing.assert_close(model.unembed(after), logits[:, scored], rtol=1e-13, atol=1e-13)
        zero = key_ablation_effects(model, PROBE, (logits, cache), scale=0.0)
    later = ~zero.loss_change.isnan()
    assert (zero.loss_change[later] == 0).all() and (zero.pattern_change[later] == 0).all()


@pytest.mark.parametrize("normalization", ["none", "layernorm"])
def test_the_attributions_clean_pass_is_run_with_cache_and_sees_the_intervention(normalization, monkeypatch):
    """The attribution's forward pass is the model's run_with_cache (bit for bit: it is that call),
    interventions included: its estimate is the derivative of the exact ablation of the intervened
    model at a small scale. Without the intervention the derivative differs, so the check can fail."""
    model = intervened_model(normalization)
    calls = []
    run_with_cache = model.run_with_cache
    monkeypatch.setattr(model, "run_with_cache", lambda *a, **k: calls.append(run_with_cache(*a, **k)) or calls[-1])
    estimate = key_attribution_effects(model, PROBE)
    with torch.inference_mode():
        reference, _ = run_with_cache(PROBE.tokens)
    assert calls and all(torch.equal(logits.detach(), reference) for logits, _ in calls)
    eps = 1e-5
    slope = (
        key_ablation_effects(model, PROBE, scale=eps).loss_change
        - key_ablation_effects(model, PROBE, scale=-eps).loss_change
    ) / (2 * eps)
    later = ~slope.isnan()
    torch.testing.assert_close(estimate.loss_change[later], slope[later], rtol=1e-5, atol=1e-8)
    with model.changes_off():
        without = key_attribution_effects(model, PROBE).loss_change
    assert not torch.allclose(without[later], slope[later], rtol=1e-3, atol=1e-6)


def test_softmax_and_the_qkv_projection_are_written_only_in_models():
    """``git grep`` outside models/ (and the tests) finds no attention softmax, no norm applied to a
    stream and no fused attention: whatever reads queries, keys, values or patterns asks the model."""
    command = [
        "git",
        "grep",
        "--untracked",
        "-nE",
        r"softmax\(|\.norm\(|final_norm\(|scaled_dot_product_attention",
        "--",
        "*.py",
    ]
    found = subprocess.run(command, cwd=REPO, capture_output=True, text=True).stdout.splitlines()
    outside = [line for line in found if not line.startswith(("models/", "tests/")) and "``" not in line]
    assert not outside, outside
    assert any(line.startswith("models/attention.py") and "softmax(" in line for line in found)
