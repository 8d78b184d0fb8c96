"""An ensemble's checkpoint, kept as one file per member: each member's ``checkpoints/last.ckpt``.

Lightning writes one checkpoint of the whole ensemble (``[n, ...]`` weights and moments); it is split
so that every member's run directory holds its own state, like any run's:

- ``state_dict``: the member's weights under the single model's names (``model.W_E [d_vocab, d_model]``),
  what every reader of a run's checkpoint reads; ``global_step``, ``epoch``, ``loops``;
- ``run``: its config and W&B id (as any run's), plus ``ensemble``: the ensemble's size, the member's
  index and the ensemble's id (what marks it as a member: :func:`member_record`);
- ``ensemble_member``: its slice of the optimizer's state and its callbacks' states.

A resume joins the members' files back into the ensemble's checkpoint (:func:`join_members`). Loaded
weights-only everywhere (plain tensors, numbers and strings).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from records.layout import RUN_KEY

MEMBER_KEY = "ensemble_member"  # the member's optimizer and callback states
ENSEMBLE_RECORD = "ensemble"  # in checkpoint[RUN_KEY]: {"size", "index", "id"}


def member_record(checkpoint: dict) -> dict | None:
    """The ``{"size", "index", "id"}`` of an ensemble member's checkpoint; None for a single run's."""
    return (checkpoint.get(RUN_KEY) or {}).get(ENSEMBLE_RECORD)


def split_member(checkpoint: dict, index: int, record: dict, callbacks: dict) -> dict:
    """Member ``index``'s checkpoint out of the ensemble's (Lightning's ``dump_checkpoint``): its weights,
    its optimizer state, the trainer's loops, ``record`` (its ``run`` entry) and ``callbacks`` (its own)."""
    (optimizer,) = checkpoint["optimizer_states"]
    return {
        "epoch": checkpoint["epoch"],
        "global_step": checkpoint["global_step"],
        "pytorch-lightning_version": checkpoint["pytorch-lightning_version"],
        "loops": checkpoint["loops"],
        "state_dict": {name: tensor[index].clone() for name, tensor in checkpoint["state_dict"].items()},
        RUN_KEY: record,
        MEMBER_KEY: {
            "optimizer": {
                key: {name: value if value.dim() == 0 else value[index].clone() for name, value in state.items()}
                for key, state in optimizer["state"].items()
            },
            "callbacks": callbacks,
        },
    }


def join_members(members: list[dict], callbacks_key: str) -> dict:
    """The ensemble's Lightning checkpoint from its members' (in member order); the members' callback
    states go under ``callbacks_key`` (the ensemble's dispatcher: ``callbacks.ensemble_members.EnsembleMembers``)."""
    first = members[0]
    names = list(first["state_dict"])
    optimizer_keys = list(first[MEMBER_KEY]["optimizer"])
    state = {
        key: {
            name: value if value.dim() == 0 else torch.stack([m[MEMBER_KEY]["optimizer"][key][name] for m in members])
            for name, value in first[MEMBER_KEY]["optimizer"][key].items()
        }
        for key in optimizer_keys
    }
    return {
        "epoch": first["epoch"],
        "global_step": first["global_step"],
        "pytorch-lightning_version": first["pytorch-lightning_version"],
        "loops": first["loops"],
        "state_dict": {name: torch.stack([m["state_dict"][name] for m in members]) for name in names},
        "optimizer_states": [{"state": state, "param_groups": [{"params": list(range(len(names)))}]}],
        "lr_schedulers": [],
        "callbacks": {callbacks_key: {"members": [m[MEMBER_KEY]["callbacks"] for m in members]}},
    }


def save_atomically(checkpoint: dict, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then renamed over it: a reader (or a kill)
    sees the old checkpoint or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(checkpoint, temporary)
    os.replace(temporary, path)
