"""A full disk, on a real small filesystem (a tmpfs mounted in a user and mount namespace of its own:
``unshare -rm``, no root needed where the kernel allows it): at start-up and mid-training the run ends in
one line naming what could not be written and the command that finishes it, exit 1, ``status.json``
saying so; the checkpoint from before the disk filled is whole, and once there is room that command
resumes it to the end. (The end-of-run report's case, the disk filling while figures are drawn, is
timing-dependent here and is measured by hand: docs/operations.md.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import NO_FIGURES, NO_WANDB, REPO, train_env

pytestmark = pytest.mark.slow

SMALL = ["trainer.max_steps=120", "trainer.checkpoint_every_n_steps=40", "trainer.enable_progress_bar=false"]

SCRIPT = r"""
set -u
mount -t tmpfs -o size=64m tmpfs "$DISK/mid" && mount -t tmpfs -o size=64k tmpfs "$DISK/start" || exit 99
if [ -n "${TESTS_START_FRESH:-}" ]; then
  python() { "$PY" "$@"; }
else  # each python below starts warm (tests/warm_start.py), forked inside this namespace
  "$PY" tests/warm_start.py --listen "$OUT/warm.sock" &
  server=$!
  trap 'kill $server 2> /dev/null' EXIT
  python() { "$PY" tests/warm_start.py --via "$OUT/warm.sock" "$@"; }
fi
RUN="$DISK/mid/run"
python train.py hydra.run.dir="$RUN" "$@" > "$OUT/mid.out" 2> "$OUT/mid.err" &
pid=$!
while [ ! -f "$RUN/checkpoints/last.ckpt" ] && kill -0 $pid 2> /dev/null; do sleep 0.02; done
dd if=/dev/zero of="$DISK/mid/filler" bs=64k 2> /dev/null  # the disk is full from here on
wait $pid; echo $? > "$OUT/mid.code"
cp "$RUN/status.json" "$OUT/mid.status.json"; cp "$RUN/checkpoints/last.ckpt" "$OUT/kept.ckpt"
rm "$DISK/mid/filler"  # room made: the command the line gave, as a user would run it
resume=$(sed -n 's/.*continue with: python //p' "$OUT/mid.err")
python $resume > "$OUT/resumed.out" 2> "$OUT/resumed.err"; echo $? > "$OUT/resumed.code"
cp "$RUN/status.json" "$OUT/resumed.status.json"; cp "$RUN/checkpoints/last.ckpt" "$OUT/resumed.ckpt"
python train.py hydra.run.dir="$DISK/start/run" "$@" > "$OUT/start.out" 2> "$OUT/start.err"; echo $? > "$OUT/start.code"
cp "$DISK/start/run/status.json" "$OUT/start.status.json"
"""


def namespaces_allowed() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory):
    if not namespaces_allowed() and not os.environ.get("REQUIRE_SLURM"):  # CI runs as root: never skipped there
        pytest.skip("unshare -rm is not allowed here (no user namespaces): no tmpfs to fill")
    disk, out = tmp_path_factory.mktemp("disk"), tmp_path_factory.mktemp("out")
    (disk / "mid").mkdir()
    (disk / "start").mkdir()
    env = train_env(DISK=str(disk), OUT=str(out), PY=sys.executable)
    args = ["unshare", "-rm", "bash", "-c", SCRIPT, "script", NO_FIGURES, NO_WANDB, *SMALL]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def ended(out, name: str) -> tuple[int, list[str], dict]:
    errors = [line for line in (out / f"{name}.err").read_text().splitlines() if "error" in line.lower()]
    return int((out / f"{name}.code").read_text()), errors, json.loads((out / f"{name}.status.json").read_text())


def test_a_disk_that_fills_mid_training_is_one_line_and_the_checkpoint_resumes(full_disk):
    code, errors, status = ended(full_disk, "mid")
    assert code == 1 and len(errors) == 1, (full_disk / "mid.err").read_text()[-3000:]
    (line,) = errors
    assert re.match(r"error: no space left on device writing \S", line) and "continue with: python train.py" in line
    assert "Traceback" not in (full_disk / "mid.err").read_text()
    assert status == {"status": "failed", "exit_code": 1, "step": None, "error": line}
    # the checkpoint from before is whole: it loads, at a step the run reached before the disk filled
    checkpoint = torch.load(full_disk / "kept.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] in (40, 80) and checkpoint["state_dict"]
    # once there is room, the line's own command continues it to the end
    code, errors, status = ended(full_disk, "resumed")
    assert code == 0, (full_disk / "resumed.err").read_text()[-3000:]
    assert status["status"] == "finished"
    assert torch.load(full_disk / "resumed.ckpt", map_location="cpu", weights_only=False)["global_step"] == 120


def test_a_disk_full_at_start_up_is_one_line_and_the_status_says_so(full_disk):
    code, errors, status = ended(full_disk, "start")
    assert code == 1 and len(errors) == 1, (full_disk / "start.err").read_text()[-3000:]
    assert errors[0].startswith("error: no space left on device writing ")
    assert "Traceback" not in (full_disk / "start.err").read_text()
    assert status["status"] == "failed" and status["error"] == errors[0]


def test_the_checkpoint_writer_leaves_the_last_checkpoint_whole_when_a_write_fails(tmp_path, monkeypatch):
    """SameDirectoryCheckpointIO: a save that fails part-way (here: its temporary file cut by an error)
    leaves the checkpoint from before byte for byte, and no partial file."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from records.checkpoint_writer import SameDirectoryCheckpointIO

    path = tmp_path / "last.ckpt"
    writer = SameDirectoryCheckpointIO()
    writer.save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    before = path.read_bytes()

    def cut_short(self, checkpoint, temporary, storage_options=None):
        shutil.copyfile(path, temporary)
        with open(temporary, "r+b") as file:
            file.truncate(10)
        raise OSError(28, "No space left on device", str(temporary))

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", cut_short)
    with pytest.raises(OSError):
        writer.save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_resume_leaves_out_a_metrics_row_cut_short(tmp_path):
    """A disk that filled (or a kill) mid-row leaves ``metrics.csv`` with a cut last row: the resumed run keeps
    the whole rows before its checkpoint's step and leaves the cut one out (its step is logged again)."""
    from records.csv_log import ResumableCSVLogger

    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text("loss,step,train/loss\n1.0,10,2.0\n0.5,20,1.5\n0.25,3")
    logger = ResumableCSVLogger(tmp_path, resume_step=40)
    assert (logger.cut_rows, logger.dropped_rows) == (1, 0)
    assert logger.experiment is not None  # made now: the kept rows written back
    assert (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[1:] == ["1.0,10,2.0", "0.5,20,1.5"]
