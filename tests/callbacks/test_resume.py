"""Resuming from a checkpoint continues training exactly: weights, optimizer and data stream."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from data.datamodule import TokenDataModule, make_sampler
from models.lit_module import InductionLM
from models.transformer import TransformerShape
from tests.helpers import LossRecorder

SHAPE = TransformerShape(n_layers=2, n_heads=2, d_model=32, d_head=8, n_ctx=17, d_vocab=21)


def fit(tmp_path, max_steps, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=10)],
        gradient_clip_val=1.0,
    )
    module = InductionLM(SHAPE, lr=3e-3, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=5)
    trainer.fit(
        module,
        datamodule=TokenDataModule(make_sampler("repeated", 0, 17, 20, True, n_min=4, n_max=8), 8),
        ckpt_path=ckpt_path,
    )
    return recorder.losses, module


def test_resume_matches_an_uninterrupted_run(tmp_path):
    straight, straight_module = fit(tmp_path / "straight", 20)
    first, _ = fit(tmp_path / "resumed", 10)
    second, resumed_module = fit(tmp_path / "resumed", 20, ckpt_path=str(tmp_path / "resumed" / "last.ckpt"))
    assert first + second == straight
    for a, b in zip(straight_module.parameters(), resumed_module.parameters()):
        assert torch.equal(a, b)
