"""AdamW over stacked weights ``[n, ...]`` with each member's own learning rate, warmup, betas and
weight decay.

Written by hand: ``torch.optim.AdamW`` takes one scalar learning rate per parameter group, and a
stacked weight is one tensor holding every member, so per-member rates cannot be parameter groups.
The update is ``torch.optim.AdamW``'s (Loshchilov & Hutter 2019, decoupled weight decay) element by
element, and the warmup is ``models.lit_module.InductionLM``'s ``LambdaLR``: update ``u`` (from 1)
uses ``lr · min(1, u / warmup_steps)``. Where every member has the same value, it stays a Python
number, as in the single model's optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from models.optimizer import OptimizerSettings

EPS = 1e-8  # torch.optim.AdamW's default, the single run's


def per_member(values: Sequence[float]) -> float | Tensor:
    """One number where every member has it, else a float64 ``[n]`` tensor."""
    return float(values[0]) if len(set(values)) == 1 else torch.tensor(values, dtype=torch.float64, device="cpu")


class EnsembleAdamW(torch.optim.Optimizer):
    """AdamW for parameters whose first axis is the member (``settings[k]``: member ``k``'s).

    ``active [n]``: members still training; a stopped member's weights and moments stay as they are.
    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (``torch.optim.AdamW``'s names)."""

    def __init__(self, params: Iterable[Tensor], settings: Sequence[OptimizerSettings]) -> None:
        super().__init__(params, defaults={})
        self.size = len(settings)
        self.lr = per_member([s.lr for s in settings])
        self.weight_decay = per_member([s.weight_decay for s in settings])
        self.beta1 = per_member([s.betas[0] for s in settings])
        self.beta2 = per_member([s.betas[1] for s in settings])
        self.warmup = per_member([float(s.warmup_steps) for s in settings])
        self.active = torch.ones(self.size, dtype=torch.bool, device="cpu")

    def stop(self, member: int) -> None:
        """Leave member ``member`` as it is from now on (a diverged member)."""
        self.active[member] = False

    def rates(self, update: int) -> float | Tensor:
        """The learning rate of update ``update`` (from 1), per member: the warmup's ramp, then ``lr``."""
        if isinstance(self.warmup, float):
            factor = 1.0 if self.warmup <= 0 else min(1.0, update / self.warmup)
        else:
            factor = torch.where(self.warmup > 0, (update / self.warmup.clamp(min=1)).clamp(max=1.0), 1.0)
        return self.lr * factor

    def coefficients(self, update: int, like: Tensor) -> dict[str, float | Tensor]:
        """Update ``update``'s per-member factors, each a number or an ``[n]`` tensor on ``like``'s
        device and in its dtype (moved once a step, not once a parameter)."""
        lr = self.rates(update)
        beta1, beta2 = self.beta1, self.beta2
        values = {
            "decay": 1 - lr * self.weight_decay,
            "one_minus_beta1": 1 - beta1,
            "beta2": beta2,
            "one_minus_beta2": 1 - beta2,
            "bias_correction2_sqrt": (1 - beta2**update) ** 0.5,
            "step_size": lr / (1 - beta1**update),
        }
        return {k: v if isinstance(v, float) else v.to(like.device, like.dtype) for k, v in values.items()}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        every = bool(self.active.all())
        factors, keep = None, None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float64, device="cpu")  # a count, kept on the host
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if factors is None:  # every parameter is at the same update
                    factors = self.coefficients(int(state["step"]), p)
                    keep = None if every else ~self.active.to(p.device)
                old = None if keep is None else p.clone()
                self._update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], factors)
                if old is not None:
                    p.copy_(torch.where(keep.view(-1, *([1] * (p.dim() - 1))), old, p))
        return loss

    @staticmethod
    def _update(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, factors: dict) -> None:
        """One AdamW update of ``p [n, ...]`` in place, in ``torch.optim.AdamW``'s order of operations."""
        shape = (-1, *([1] * (p.dim() - 1)))
        f = {k: v if isinstance(v, float) else v.view(shape) for k, v in factors.items()}
        p.mul_(f["decay"])
        exp_avg.lerp_(grad, f["one_minus_beta1"])
        exp_avg_sq.mul_(f["beta2"])
        if isinstance(f["one_minus_beta2"], float):
            exp_avg_sq.addcmul_(grad, grad, value=f["one_minus_beta2"])
        else:
            exp_avg_sq.add_(grad * grad * f["one_minus_beta2"])
        denom = (exp_avg_sq.sqrt() / f["bias_correction2_sqrt"]).add_(EPS)
        if isinstance(f["step_size"], float):
            p.addcdiv_(exp_avg, denom, value=-f["step_size"])
        else:
            p.sub_(f["step_size"] * exp_avg / denom)
