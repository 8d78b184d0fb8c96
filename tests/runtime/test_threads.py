"""How torch's OpenMP threads wait: bounded spinning unless the environment already says (runtime/threads.py)."""

from __future__ import annotations

import pytest

from runtime.threads import SPIN_COUNT, bounded_spinning


def test_idle_threads_spin_a_bounded_while_by_default():
    assert bounded_spinning({"PATH": "/usr/bin"}) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


@pytest.mark.parametrize(
    "setting", [{"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}]
)
def test_a_wait_the_user_set_is_kept(setting):
    """Nothing is added where the user chose: with ``PASSIVE``, a spin count on top made a loaded QR 5 times slower."""
    assert bounded_spinning(setting) == {}
