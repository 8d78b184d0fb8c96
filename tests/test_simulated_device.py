"""The simulated accelerator (``tests/simulated_device.py``) that the CUDA / Apple-silicon tests run under:
it names each planted mistake in project code at its line, and follows where tensors live (a model
built with ``device="cpu"`` on the host; its parameters on the model's device once moved there)."""

from __future__ import annotations

import pytest
import torch

from models.transformer import AttentionOnlyTransformer, TransformerShape
from tests.helpers import REPO
from tests.simulated_device import SimulatedAccelerator

PLANTED = REPO / "metrics" / "planted_for_the_simulator.py"
"""A path in the project (no such file): code compiled under it counts as the project's."""
SHAPE = TransformerShape(n_layers=1, n_heads=2, d_model=8, d_head=4, n_ctx=5, d_vocab=7)
KINDS = ("missing_device", "mixed", "float64_on_device", "not_on_mps")


def planted(source: str, **names) -> dict:
    """Run ``source`` as if it were a line of the project's; returns its names."""
    exec(compile(source, str(PLANTED), "exec"), names)
    return names


@pytest.mark.parametrize(
    "source, kind",
    [
        ("torch.zeros(3)", "missing_device"),
        ("weights @ torch.ones(4, 4, device='cpu')", "mixed"),
        ("weights.double()", "float64_on_device"),
        ("torch.linalg.eigvals(weights)", "not_on_mps"),
    ],
)
def test_a_planted_mistake_is_named_at_its_line(source, kind):
    weights = torch.randn(4, 4)  # made before the simulator: the model's device
    with SimulatedAccelerator(strict=False) as accelerator:
        planted(source, torch=torch, weights=weights)
    assert [len(getattr(accelerator, k)) for k in KINDS] == [int(k == kind) for k in KINDS]
    assert getattr(accelerator, kind)[0].startswith("metrics/planted_for_the_simulator.py:1 ")


def test_a_model_built_for_the_cpu_is_the_hosts_until_it_is_moved():
    with SimulatedAccelerator() as accelerator:  # strict: a mistake raises
        names = planted(
            "model = AttentionOnlyTransformer(shape, device='cpu').double()\n"  # float64 on the CPU: allowed
            "model(torch.zeros(2, 5, dtype=torch.long, device='cpu'))\n"
            "on_host = [accelerator.on_host(p) for p in model.parameters()]\n"
            "model.float().to(torch.device('cpu'))\n",  # a torch.device: the accelerator's
            AttentionOnlyTransformer=AttentionOnlyTransformer,
            shape=SHAPE,
            torch=torch,
            accelerator=accelerator,
        )
        assert names["on_host"] and all(names["on_host"])
        assert not any(accelerator.on_host(p) for p in names["model"].parameters())
        with pytest.raises(Exception, match="float64 tensor"):
            planted("model.double()", model=names["model"])
