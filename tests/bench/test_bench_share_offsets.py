"""bench.share_offsets on a run whose answer is known: the hand-built induction circuit, whose
induction head's keys read the previous-token head's write alone, so the writer's K share is 1 on
every probe, wherever its copies start."""

from __future__ import annotations

import json

import numpy as np
import torch

from bench.share_offsets import main, offset_probes
from records.layout import HYDRA_DIR, HYDRA_OVERRIDES, SUMMARY_NAME, TENSORS_DIR
from records.tensor_store import TensorStore
from records.trajectory import TrajectoryWriter
from tests.helpers import induction_circuit_model


def test_the_probes_hold_the_same_copies_at_fixed_and_moving_starts():
    (fixed, fixed_rows), (moving, moving_rows) = offset_probes(batch=32, n=5, shift=4, n_random=8)
    assert fixed.shape == moving.shape == (32, 2 * 5 + 1 + 4)
    assert (fixed[:, 0] == 8).all() and (moving[:, 0] == 8).all()  # BOS
    assert fixed.max() <= 8 and moving.max() <= 8
    starts = []
    for tokens, rows in ((fixed, fixed_rows), (moving, moving_rows)):
        for b in range(32):
            second = rows[b].nonzero().flatten()
            assert len(second) == 5 and (second.diff() == 1).all()  # one second copy a sequence
            first = second - 5
            assert torch.equal(tokens[b, second], tokens[b, first])
            starts.append(int(first[0]))
    assert set(starts[:32]) == {1}  # fixed: every copy starts after BOS
    assert len(set(starts[32:])) > 2  # moving: the starts spread over 1 .. 1 + shift
    blocks = lambda tokens, rows: torch.stack([tokens[b, rows[b].bool()] for b in range(32)])
    assert torch.equal(blocks(fixed, fixed_rows), blocks(moving, moving_rows))  # the same copies


def write_circuit_run(run_dir) -> None:
    """A run directory: the hand-built circuit saved at steps 0 and 10, its ablation hurting the loss
    most for L0H0 -> L1H0."""
    model = induction_circuit_model().double()
    with torch.no_grad():  # no distractor writes: L1H0's keys read the previous-token head's write alone
        model.layers[0].W_O[1].zero_()
    writer = TrajectoryWriter(run_dir / "trajectory", model.shape, {})
    for step in (0, 10):
        writer.add(step, model.state_dict(), ["linear"])
    (run_dir / HYDRA_DIR).mkdir(parents=True)
    (run_dir / HYDRA_DIR / HYDRA_OVERRIDES).write_text("[]\n")
    (run_dir / SUMMARY_NAME).write_text(
        json.dumps({"phase_change/loss_onset_step": 3.0, "phase_change/loss_end_step": 7.0})
    )
    effects = np.full((2, 2, 2, 2), 0.01, dtype=np.float32)
    effects[0, 0, 1, 0] = 2.0
    with TensorStore(run_dir / TENSORS_DIR) as store:
        store.append(10, {"ablation/loss_change": effects})


def test_a_reader_whose_keys_read_only_the_writer_reads_share_one_on_every_probe(tmp_path, capsys):
    write_circuit_run(tmp_path / "run")
    assert main([str(tmp_path / "run"), "--steps", "0,10", "--shift", "2", "--batch", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("run: L0H0->L1H0 (onset 3, end 7); n 3, start 0 or 0-2")
    rows = [line.split() for line in out[3:5]]
    assert [row[0] for row in rows] == ["0", "10"]
    assert all(float(v) == 1.0 for row in rows for v in row[1:]), out
    assert out[-2].startswith("centred over sequences: |fixed - moving| median 0.000, largest 0.000")


def test_a_request_it_cannot_read_is_refused_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nothing")]) == 1
    assert capsys.readouterr().err.startswith("error: no run directory in")
    write_circuit_run(tmp_path / "run")
    assert main([str(tmp_path / "run"), "--shift", "7"]) == 1  # n_ctx 9: no room for two copies
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "leaves no room for two copies" in err
    assert main([str(tmp_path / "run"), "--steps", "ten"]) == 1
    assert "--steps 'ten'" in capsys.readouterr().err
