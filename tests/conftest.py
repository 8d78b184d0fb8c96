"""Shared fixtures. Tests never touch the network: W&B runs offline into pytest's tmp_path."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: no spinning threads on a shared machine
# random baselines are cached on disk: keep the tests' cache out of the user's home
os.environ.setdefault(
    "INDUCTION_TRACKER_CACHE", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"induction-tracker-tests-{os.getuid()}")
)
