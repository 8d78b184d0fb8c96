"""The stop-signal handler itself, in-process: what it may and may not do while the main thread is busy."""

from __future__ import annotations

import io
import os
import signal
import sys

from callbacks.preemption import StopOnSignal
from records.status import STOP_SIGNALS


class SignalledMidWrite(io.RawIOBase):
    """A pipe whose first write is interrupted by SIGTERM, as a progress line into a full pipe is
    when the reader is slow: the handler then runs while the main thread holds the stream's buffer."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.signalled = False

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler here, inside this write
        self.written += data
        return len(data)


def test_a_signal_during_a_buffered_write_is_recorded_and_the_write_completes(tmp_path, monkeypatch):
    pipe = SignalledMidWrite()
    stdout = io.TextIOWrapper(io.BufferedWriter(pipe), write_through=True)
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stdout)
    stop = StopOnSignal(tmp_path / "last.ckpt")
    stop.on_train_start(None, None)
    try:
        print("step 17/40  loss 2.3000", flush=True)  # a print() in the handler: "reentrant call" here
    finally:
        stop.teardown(None, None, "fit")
    assert stop.received == signal.SIGTERM
    assert bytes(pipe.written) == b"step 17/40  loss 2.3000\n"
    assert signal.getsignal(signal.SIGTERM) is not stop._on_signal  # handlers handed back


def test_after_a_fit_every_stop_signal_has_the_handler_it_had_before(tmp_path):
    """Lightning hands back the handlers it replaced before it calls the callbacks' teardown: ours must
    not then put back Lightning's (a SIGTERM after training would set a flag on a finished Trainer)."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    trainer = L.Trainer(
        max_steps=2,
        callbacks=[StopOnSignal(tmp_path / "last.ckpt")],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    assert {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == before
