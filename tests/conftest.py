"""Shared fixtures. Tests never touch the network: W&B runs offline into pytest's tmp_path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: no spinning threads on a shared machine
# random baselines are cached on disk: keep the tests' cache out of the user's home
os.environ.setdefault(
    "INDUCTION_TRACKER_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"induction-tracker-tests-{os.getuid()}")
)

import pytest  # noqa: E402  (after the environment: OpenMP reads OMP_WAIT_POLICY when torch loads)
import torch  # noqa: E402

from models.transformer import AttentionOnlyTransformer, TransformerShape  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def random_model(
    normalization: str = "none", n_layers: int = 3, n_heads: int = 3, seed: int = 0
) -> AttentionOnlyTransformer:
    """A small model with random weights and, with normalization, random non-unit gains."""
    torch.manual_seed(seed)
    model = AttentionOnlyTransformer(
        TransformerShape(
            n_layers=n_layers, n_heads=n_heads, d_model=24, d_head=5, n_ctx=17, d_vocab=11, normalization=normalization
        )
    )
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
                module.weight.copy_(0.5 + torch.rand_like(module.weight))
    return model


def train_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1", **extra)


def run_train(args: list[str], tmp_path: Path, timeout: int = 300, env: dict[str, str] | None = None):
    """Run ``python train.py ARGS`` in a subprocess with its outputs under ``tmp_path``."""
    import subprocess

    command = [
        sys.executable,
        str(REPO / "train.py"),
        f"hydra.run.dir={tmp_path}",
        "trainer.enable_progress_bar=false",
        *args,
    ]
    return subprocess.run(command, cwd=REPO, env=env or train_env(), capture_output=True, text=True, timeout=timeout)


def run_train_until(args: list[str], step: int, signum: int, env: dict[str, str] | None = None, timeout: int = 300):
    """Run ``python train.py ARGS`` and send it ``signum`` once it reports step ``step`` (a progress
    line every step). Returns (exit code, everything it printed)."""
    import subprocess

    command = [
        sys.executable,
        str(REPO / "train.py"),
        "trainer.enable_progress_bar=true",
        "trainer.progress_every_n_steps=1",
        *args,
    ]
    process = subprocess.Popen(
        command, cwd=REPO, env=env or train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    printed, sent = [], False
    try:
        for line in process.stdout:
            printed.append(line)
            if not sent and line.startswith(f"step {step}/"):
                process.send_signal(signum)
                sent = True
        return process.wait(timeout=timeout), "".join(printed)
    finally:
        if process.poll() is None:
            process.kill()


class CodeRunningPayload:
    """Unpickling this creates a file: what a crafted checkpoint would do to a careless loader."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def repo() -> Path:
    return REPO
