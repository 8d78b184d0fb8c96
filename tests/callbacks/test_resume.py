"""Resuming from a checkpoint continues training exactly: weights, optimizer and data stream."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.helpers import LossRecorder, fit_repeated, quiet_trainer


def fit(tmp_path, max_steps, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=10)
    trainer = quiet_trainer([recorder, checkpoints], max_steps, enable_checkpointing=True, gradient_clip_val=1.0)
    module = fit_repeated(trainer, warmup_steps=5, ckpt_path=ckpt_path)
    return recorder.losses, module


def test_resume_matches_an_uninterrupted_run(tmp_path):
    straight, straight_module = fit(tmp_path / "straight", 20)
    first, _ = fit(tmp_path / "resumed", 10)
    second, resumed_module = fit(tmp_path / "resumed", 20, ckpt_path=str(tmp_path / "resumed" / "last.ckpt"))
    assert first + second == straight
    for a, b in zip(straight_module.parameters(), resumed_module.parameters()):
        assert torch.equal(a, b)
