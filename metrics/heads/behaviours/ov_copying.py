"""OV copying heads, read from what a head writes: Elhage et al. 2021's copying score of the head's full OV
circuit ``W_E W_OV W_U [d_vocab, d_vocab]`` ("A Mathematical Framework for Transformer Circuits", "Copying
and the OV circuit"), ``Σ Re λ / Σ |λ|`` of its eigenvalues in ``[-1, 1]``: 1 when every eigenvalue is
positive (the circuit raises the token the head attends to), -1 when every one is negative. Read from the
weights alone (:func:`~metrics.heads.circuit_scores.copying_scores`, in ``d_head`` space)."""

from __future__ import annotations

from torch import Tensor

from metrics.heads.behaviours.base import Behaviour, HeadWrites
from metrics.heads.circuit_scores import copying_scores


class OVCopying(Behaviour):
    """The OV circuit's eigenvalue copying score of every head."""

    name = "ov_copying"
    colour = "tab:pink"
    reads = "writes"

    @staticmethod
    def score(writes: HeadWrites) -> Tensor:
        return copying_scores(writes.model, writes.circuits)
