"""Online W&B with an unreachable server: the run falls back to offline, says how to sync, loses nothing.

Every server here is local (127.0.0.1): a port nothing listens on, a tiny HTTP server, a socket that
never answers. Nothing reaches the network.
"""

from __future__ import annotations

import csv
import http.server
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from records import wandb_records
from records.wandb_reach import effective_mode, server_url, sync_command
from tests.helpers import REPO, WITH_WANDB, run_train


@pytest.fixture(autouse=True)
def environment(monkeypatch):
    """No proxy between the check and the local servers; what a fallback sets is undone after each test."""
    for name in (
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "WANDB_ERROR_REPORTING",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def refusing_url(monkeypatch) -> str:
    """``$WANDB_BASE_URL`` at a local port that refuses connections (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("WANDB_BASE_URL", url)
    return url


def serve(status: int, monkeypatch):
    """A local HTTP server answering every GET with ``status``, as ``$WANDB_BASE_URL``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}/")
    return server


def test_refused_connection_falls_back_offline_with_one_sync_line(refusing_url, tmp_path, capsys):
    start = time.monotonic()
    assert effective_mode("online", 5.0, tmp_path) == "offline"
    assert time.monotonic() - start < 5.0  # refused at once: no waiting out the deadline
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"warning: W&B server {refusing_url} unreachable (ConnectionRefusedError")
    assert lines[0].endswith(f"upload later with: wandb sync {tmp_path}/wandb/offline-run-*")
    assert os.environ["WANDB_ERROR_REPORTING"] == "false"  # wandb's analytics would call the server at exit


def test_answering_server_stays_online(monkeypatch, tmp_path, capsys):
    server = serve(404, monkeypatch)  # any answer below 500 (404, 401, ...) means the server is there
    try:
        assert effective_mode("online", 5.0, tmp_path) == "online"
    finally:
        server.shutdown()
    assert capsys.readouterr().err == ""


def test_gateway_error_falls_back_offline(monkeypatch, tmp_path, capsys):
    server = serve(503, monkeypatch)
    try:
        assert effective_mode("online", 5.0, tmp_path) == "offline"
    finally:
        server.shutdown()
    assert "(HTTP 503)" in capsys.readouterr().err


def test_silent_server_falls_back_at_the_deadline(monkeypatch, tmp_path, capsys):
    with socket.socket() as sock:  # connections are accepted by the kernel, and never answered
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{sock.getsockname()[1]}")
        start = time.monotonic()
        assert effective_mode("online", 0.5, tmp_path) == "offline"
        elapsed = time.monotonic() - start
    assert 0.4 < elapsed < 2.0, elapsed
    assert "within 0.5 s: logging offline" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_other_modes_are_not_checked(mode, refusing_url, tmp_path, capsys):
    assert effective_mode(mode, 5.0, tmp_path) == mode
    assert capsys.readouterr().err == ""


def test_server_url_and_sync_command(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com/")
    assert server_url() == "https://wandb.example.com"
    assert sync_command(tmp_path / "a b") == f"wandb sync '{tmp_path}/a b'/wandb/offline-run-*"


def test_server_url_from_wandb_settings_file(tmp_path):
    """Without ``$WANDB_BASE_URL``, the server ``wandb login --host`` saved (in a subprocess: wandb's
    settings are loaded once per process)."""
    (tmp_path / "settings").write_text("[default]\nbase_url = http://wandb.internal:8080\n")
    env = {key: value for key, value in os.environ.items() if key != "WANDB_BASE_URL"}
    env.update(WANDB_CONFIG_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    command = [sys.executable, "-c", "from records.wandb_reach import server_url; print(server_url())"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip().splitlines()[-1] == "http://wandb.internal:8080", result.stderr[-2000:]


def train_online(args: list[str], run_dir):
    """:func:`~tests.helpers.run_train` as a user runs it: W&B online from the config, no ``$WANDB_MODE`` in
    the environment (in this process: the fallback is train.py's, not the interpreter's)."""
    env = {key: value for key, value in os.environ.items() if key != "WANDB_MODE"}
    env.update(WANDB_SILENT="true")
    online = [WITH_WANDB, "logger.wandb.mode=online", "trainer.max_steps=20", "tracker.enabled=false", *args]
    return run_train(online, run_dir, environ=env)


@pytest.mark.slow
@pytest.mark.parametrize("server", ["refusing", "silent"])
def test_train_online_without_server_completes_offline_losing_nothing(server, refusing_url, monkeypatch, tmp_path):
    with socket.socket() as silent:
        args = []
        if server == "silent":  # accepts connections, never answers: the configured deadline decides
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
            args = ["logger.wandb.connect_timeout_s=2"]
        start = time.monotonic()
        result = train_online(args, tmp_path)
        elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert elapsed < 30, elapsed
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: W&B server")]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert os.environ["WANDB_BASE_URL"] in warnings[0] and f"wandb sync {tmp_path}/wandb/offline-run-*" in warnings[0]
    assert ("within 2 s" if server == "silent" else "ConnectionRefusedError") in warnings[0]
    assert "Traceback" not in result.stderr
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    # no metric lost: every training loss of the CSV log is in the W&B run file, at its step
    logged = {
        row["trainer/global_step"]: row["train/loss"] for row in wandb_records.history(runs[0]) if "train/loss" in row
    }
    with open(tmp_path / "csv" / "metrics.csv", newline="") as handle:
        expected = {
            int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")
        }
    assert len(expected) >= 2 and sorted(logged) == sorted(expected)
    assert all(math.isclose(logged[step], loss, rel_tol=1e-6) for step, loss in expected.items())
