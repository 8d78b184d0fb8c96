"""The optimizer's settings: plain values with their checks, free of Lightning and torch (the config
reads them before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimizerSettings:
    """AdamW (lr, weight decay, betas) after a linear warmup of ``warmup_steps`` (0: none)."""

    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 100

    def problems(self) -> list[str]:
        """Every problem of these values at once, one sentence each naming the field."""
        problems = []
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(f"betas={list(self.betas)} must be two numbers in [0, 1)")
        if self.lr <= 0:
            problems.append(f"lr={self.lr} must be > 0")
        if self.weight_decay < 0:
            problems.append(f"weight_decay={self.weight_decay} must be >= 0")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps={self.warmup_steps} must be >= 0")
        return problems
