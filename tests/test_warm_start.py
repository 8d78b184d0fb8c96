"""The warm start of the process tests (tests/warm_start.py) against its reference, a fresh interpreter:
the same script, run both ways, must see and leave the same process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests import warm_start
from tests.helpers import train_env

pytestmark = pytest.mark.slow

PROBE = """
import atexit, json, logging, os, signal, sys
logging.basicConfig()  # as Hydra sets logging up before train.py imports Lightning
import lightning
import extra_module  # from PYTHONPATH
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({
    "argv": sys.argv, "path": sys.path[:2], "cwd": os.getcwd(), "asked": os.environ.get("ASKED"),
    "main": __name__, "file": __file__, "extra": extra_module.__file__,
    "lightning handlers": [type(h).__name__ for h in logging.getLogger("lightning.pytorch").handlers],
    "propagates": logging.getLogger("lightning.pytorch").propagate,
    "sigint": getattr(signal.getsignal(signal.SIGINT), "__name__", str(signal.getsignal(signal.SIGINT))),
    "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
    "torch threads": __import__("torch").get_num_threads(),
}), flush=True)
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_warm_child_starts_and_ends_as_a_fresh_interpreter_would(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "extra_module.py").write_text("")
    env = train_env(ASKED="yes", PYTHONPATH=str(tmp_path / "extra"))
    command = [sys.executable, str(tmp_path / "probe.py"), "an argument"]
    fresh = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    warm = warm_start.run(command, tmp_path, env, timeout=120)
    assert warm_start.server_for(env) is not None  # it did start warm
    assert fresh.returncode == 3, fresh.stderr
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_warm_child_is_ended_by_the_signals_a_process_is_ended_by(tmp_path):
    (tmp_path / "wait.py").write_text("import time\nprint('waiting', flush=True)\ntime.sleep(60)\n")
    command = [sys.executable, str(tmp_path / "wait.py")]
    # an uncaught KeyboardInterrupt ends Python by SIGINT after its traceback (as it does since 3.8)
    for signum in (signal.SIGTERM, signal.SIGINT):
        process = warm_start.popen(command, tmp_path, train_env(), subprocess.PIPE, subprocess.STDOUT, "default")
        assert process.stdout.readline() == "waiting\n"
        process.send_signal(signum)
        printed = process.communicate(timeout=30)[0]
        assert process.returncode == -signum, printed
        assert signum != signal.SIGINT or printed.rstrip().endswith("KeyboardInterrupt")


def test_an_environment_read_while_python_and_torch_start_gets_a_fresh_interpreter():
    assert warm_start.server_for(train_env()) is not None
    for name, value in [("OMP_NUM_THREADS", "7"), ("PYTHONPROFILEIMPORTTIME", "1"), ("LD_PRELOAD", "x.so")]:
        assert warm_start.server_for(train_env(**{name: value})) is None, name
    assert warm_start.server_for(dict(train_env(), PYTHONPATH="/elsewhere", WANDB_MODE="disabled")) is not None


def test_a_warm_python_c_runs_its_code_as_main_with_the_working_directory_first(tmp_path):
    code = "import json, sys; print(json.dumps([sys.argv, sys.path[0], __name__, 'torch' in sys.modules]))"
    result = warm_start.run([sys.executable, "-c", code, "an argument"], tmp_path, train_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [["-c", "an argument"], "", "__main__", True]  # torch: the server's
