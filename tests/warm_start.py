"""``python train.py ARGS`` (or ``python -m MODULE ARGS``, ``python -c CODE ARGS``) as a real process of its own that starts warm:
forked from a server that has imported what Lightning imports (torch, torchmetrics) once for the test
session and run nothing (pytest-xdist's workers share it; a shell script's commands reach one with
``--via``), as the ensemble forks its parts (``runtime/ensemble_job.py``, ``worker_context``).
The child is what a fresh interpreter would be from there on: it imports the project's own modules
itself, has its own pid, gets its own signals, prints to its own stdout and stderr, runs in the
environment and working directory it was given, and leaves as ``python train.py`` leaves
(``SystemExit``'s status; an escaping exception's traceback, the warm start's two frames above the
script's, and status 1; atexit handlers and the interpreter's finalization; or the signal that killed
it). What it skips is ~5.5 of the ~6.5 s of CPU a fresh interpreter spends importing torch and Lightning
with every extra installed (a one-step run: 1.6 s of CPU warm, 7.5 s fresh), about 35 times a suite.

What a warm child cannot honour is an environment that Python or what the server imported read while
starting (``OMP_NUM_THREADS``, ``LD_PRELOAD``, ``PYTHONPROFILEIMPORTTIME``, ...): :func:`popen` starts a
fresh interpreter for a command whose environment differs from the server's there (``PYTHONPATH`` is
honoured: the child's ``sys.path`` is laid out as a fresh interpreter's would be), and the tests of start-up
itself (a signal while a run starts, what a refusal imports) start ``python`` themselves.
``TESTS_START_FRESH=1`` starts every process fresh (to compare, or to rule the warm start out), as does a
platform without ``os.fork``.

Written by hand because multiprocessing's fork server (the ensemble's) runs a child's target and ends
it with ``os._exit``: no atexit handler, no finalization (W&B's and Lightning's exit paths, which these
tests are about), and the child writes to the server's stdout, not to a pipe of the test's.

The server is this file run as a script (:class:`Server`); a child leaves the server's loop by returning
from :func:`serve` and becomes the command (:func:`become`)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

STARTED_AT_IMPORT = (
    *("PYTHON", "LANG", "LC_", "LD_", "MALLOC", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMPY_", "SCIPY_"),
    *("TORCH", "PYTORCH", "CUDA", "HF_", "TRANSFORMERS_", "TOKENIZERS_"),
)
"""Environment variables read while Python and what the server imports start (by prefix): a command whose
values differ from the server's starts a fresh interpreter."""

HONOURED = ("PYTHONPATH",)
"""Variables of :data:`STARTED_AT_IMPORT` a warm child honours all the same."""


# --- the test's side ------------------------------------------------------------------------------


def read_at_start(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(STARTED_AT_IMPORT) and k not in HONOURED}


class Server:
    """A fork server: started on the first warm command, ended when the test session ends. Under pytest-xdist
    the workers share one (:data:`SHARED`), listening at a path, started by the first worker that needs it;
    else this process has one of its own on a socket pair, ended when this process ends. ``exits``: the
    exit status of each of this process's children that has ended, by pid."""

    def __init__(self, environ: dict[str, str]):
        self.exits, self.next_id = {}, 0
        shared = os.environ.get(SHARED)
        if shared:
            self.channel, self.environ = connect_shared(shared, environ)
            return
        self.environ = dict(environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], env=self.environ, pass_fds=[theirs.fileno()])
        theirs.close()
        self.channel = ours

    def start(self, argv: list[str], cwd: str, environ: dict[str, str], stdout: int, stderr: int, sigint: str) -> int:
        """Fork a child that runs ``argv`` (``["train.py", ...]``, ``["-m", "module", ...]`` or ``["-c", code, ...]``);
        its pid."""
        self.next_id += 1
        request = {"id": self.next_id, "argv": argv, "cwd": cwd, "env": environ, "sigint": sigint}
        socket.send_fds(self.channel, [json.dumps(request).encode()], [stdout, stderr])
        while True:
            message = self.receive(None)
            if message.get("id") == self.next_id:
                return message["pid"]

    def receive(self, timeout: float | None) -> dict:
        """The server's next message (an exit is noted in :attr:`exits`); ``{}`` after ``timeout``."""
        ready, _, _ = select.select([self.channel], [], [], timeout)
        if not ready:
            return {}
        data = self.channel.recv(1 << 16)
        if not data:
            raise RuntimeError("the warm-start server has ended")
        message = json.loads(data)
        if "exit" in message:
            self.exits[message["pid"]] = message["exit"]
        return message


SHARED = "TESTS_WARM_START_SOCKET"
"""Where the session's shared server listens (set by the pytest-xdist controller, :func:`share`)."""


OWNER = "TESTS_WARM_START_OWNER"
"""The pid of the process that asked for a shared server: the server ends when it has."""


def share(directory: str) -> None:
    """Have this process's children (pytest-xdist's workers) share one server, listening in ``directory``."""
    os.environ[SHARED] = os.path.join(directory, "server.sock")
    os.environ[OWNER] = str(os.getpid())


def stop_shared() -> None:
    """End the shared server, if one was started, and remove its directory (the controller, at the session's end)."""
    path = os.environ.get(SHARED)
    if not path:
        return
    if os.path.exists(path + ".json"):
        with open(path + ".json") as file:
            pid = json.load(file)["pid"]
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def connect_shared(path: str, environ: dict[str, str]) -> tuple[socket.socket, dict[str, str]]:
    """A channel to the shared server at ``path`` and the environment it started in; the first worker to ask
    starts it (in its environment with ``environ``'s start-up variables), under a lock the others wait on."""
    import fcntl

    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path + ".json"):
            started = {**os.environ, **read_at_start(environ)}
            server = subprocess.Popen([sys.executable, __file__, "--listen", path], env=started)
            with open(path + ".json", "w") as file:
                json.dump({"pid": server.pid, "environ": started}, file)
        with open(path + ".json") as file:
            started = json.load(file)["environ"]
    return connect(path), started


def connect(path: str, patience: float = 300) -> socket.socket:
    """A channel to the server listening at ``path``, once it listens (it binds once it has imported what it
    preloads)."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    deadline = time.monotonic() + patience
    while True:
        try:
            channel.connect(path)
            return channel
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no warm-start server answers at {path}") from None
            time.sleep(0.05)


_server: Server | None = None


def server_for(environ: dict[str, str]) -> Server | None:
    """The fork server whose children can run in ``environ``, started on first use; None where a fresh
    interpreter must start instead (:data:`STARTED_AT_IMPORT`)."""
    global _server
    if os.environ.get("TESTS_START_FRESH") or not hasattr(os, "fork"):  # asked, or no fork (Windows)
        return None
    if _server is None:
        _server = Server({**os.environ, **read_at_start(environ)})
    return _server if read_at_start(_server.environ) == read_at_start(environ) else None


class WarmProcess:
    """A child of the server, with what the tests use of :class:`subprocess.Popen`: ``pid``, ``stdout``
    (with ``stdout=PIPE``), ``returncode``, :meth:`poll`, :meth:`wait`, :meth:`send_signal`, :meth:`kill`,
    :meth:`communicate`."""

    def __init__(self, server: Server, pid: int, stdout):
        self.server, self.pid, self.stdout, self.returncode = server, pid, stdout, None

    def poll(self) -> int | None:
        while self.returncode is None and self.pid not in self.server.exits and self.server.receive(0):
            pass
        if self.pid in self.server.exits:
            self.returncode = self.server.exits[self.pid]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.pid, timeout)
            self.server.receive(left)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, None]:
        printed = self.stdout.read() if self.stdout is not None else None
        self.wait(timeout)
        return printed, None

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(
    command: list[str], cwd, env: dict[str, str], stdout=None, stderr=None, sigint: str = "inherited"
) -> WarmProcess | subprocess.Popen:
    """``subprocess.Popen(command, cwd=cwd, env=env, stdout=..., stderr=..., text=True)`` for a command
    ``[sys.executable, SCRIPT or -m MODULE or -c CODE, ...]``, warm where ``env`` allows (:func:`server_for`).
    ``stdout``: None (inherited), ``subprocess.PIPE`` or a file; ``stderr``: None, a file or
    ``subprocess.STDOUT``. ``sigint="default"``: the child starts with Ctrl-C as KeyboardInterrupt even
    where this process ignores it (a fresh interpreter given SIGINT's default disposition)."""
    assert command[0] == sys.executable, command
    server = server_for(env)
    if server is None:
        restore = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sigint == "default" else None
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True, preexec_fn=restore)
    pipe = None
    if stdout == subprocess.PIPE:
        pipe, out = os.pipe()
    else:
        out = 1 if stdout is None else stdout.fileno()
    err = out if stderr == subprocess.STDOUT else 2 if stderr is None else stderr.fileno()
    try:
        pid = server.start(list(map(str, command[1:])), str(cwd), dict(env), out, err, sigint)
    finally:
        if pipe is not None:
            os.close(out)
    return WarmProcess(server, pid, None if pipe is None else open(pipe, encoding="utf-8"))


def run(command: list[str], cwd, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``,
    warm where ``env`` allows (:func:`popen`)."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        process = popen(command, cwd, env, out, err)
        try:
            process.wait(timeout)
        finally:
            if process.poll() is None:
                process.kill()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())


# --- the server's side ----------------------------------------------------------------------------


def serve(channels: list[socket.socket], listener: socket.socket | None = None) -> tuple[dict, list[int]]:
    """Fork a child for each request on ``channels`` (and on each connection ``listener`` accepts), and tell
    the requester the child's pid and, when it ends, its exit status (negative: the signal that ended it, as
    :class:`subprocess.Popen` says). Without a listener the server ends when its last channel closes (its
    test worker has ended). Returns (in a child only) its request and its stdout and stderr."""
    children: dict[int, socket.socket] = {}
    while True:
        waiting = [*channels, *([listener] if listener else [])]
        ready, _, _ = select.select(waiting, [], [], 0.05 if children else 1.0 if listener else None)
        if listener is not None and not owner_alive():
            os._exit(0)
        for pid, channel in list(children.items()):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                del children[pid]
                try:
                    channel.send(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:  # its requester has gone
                    pass
        for channel in ready:
            if channel is listener:
                channels.append(listener.accept()[0])
                continue
            data, fds, _, _ = socket.recv_fds(channel, 1 << 20, 2)
            if not data:
                channels.remove(channel)
                channel.close()
                if listener is None and not channels:
                    os._exit(0)
                continue
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                for own in waiting:
                    own.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            children[pid] = channel
            channel.send(json.dumps({"id": request["id"], "pid": pid}).encode())


def become(request: dict, fds: list[int], path_after_start: list[str]) -> None:
    """Turn this forked child into ``python ARGV`` as a fresh interpreter would start it: its stdout and
    stderr, working directory, environment, ``sys.argv`` and ``sys.path`` (the script's directory, the
    working directory or ``''`` first, then ``PYTHONPATH``, then the interpreter's own), then run it as
    ``__main__``."""
    import runpy

    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
    for fd in set(fds) - {1, 2}:
        os.close(fd)
    if not sys.stdout.write_through:  # line-buffered where a fresh interpreter's stdout would be: a terminal
        sys.stdout.reconfigure(line_buffering=os.isatty(1))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["sigint"] == "default":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = request["argv"]
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-c":  # the code runs in a __main__ of its own, the working directory first on the path ('')
        import types

        sys.path[:] = ["", *extra, *path_after_start]
        sys.argv = ["-c", *argv[2:]]
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.path[:] = [os.getcwd(), *extra, *path_after_start]
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[:] = [os.path.dirname(os.path.realpath(script)), *extra, *path_after_start]
        sys.argv = list(argv)
        runpy.run_path(script, run_name="__main__")


def via(path: str, argv: list[str]) -> None:
    """``python warm_start.py --via PATH ARGV``: run ``python ARGV`` as a child of the server listening at
    ``PATH`` (:func:`listen`), with this process's stdout, stderr, working directory and environment, and
    leave as it leaves (its exit status, or the signal that ended it); a signal sent here is not passed on.
    For a shell script's commands (``"$PY" tests/warm_start.py --via "$SOCKET" train.py ...``): this process
    imports nothing heavy."""
    channel = connect(path)
    request = {"id": 1, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "sigint": "inherited"}
    socket.send_fds(channel, [json.dumps(request).encode()], [1, 2])
    pid = json.loads(channel.recv(1 << 16))["pid"]
    while True:
        data = channel.recv(1 << 16)
        if not data:
            sys.exit("error: the warm-start server ended before its child")
        message = json.loads(data)
        if message.get("pid") == pid and "exit" in message:
            break
    code = message["exit"]
    if code < 0:  # ended by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def owner_alive() -> bool:
    """Whether the process that asked for this listening server (:data:`OWNER`) still runs (True if none did)."""
    try:
        os.kill(int(os.environ[OWNER]), 0)
    except ProcessLookupError:
        return False
    except (KeyError, PermissionError):  # none asked; or it runs, outside this user namespace
        pass
    return True


def listen(path: str) -> socket.socket:
    """The server's socket at ``path`` (bound once the server has imported what it preloads)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    return listener


if __name__ == "__main__":
    # python warm_start.py FD (a worker's server, on its end of a socket pair), --listen PATH (a server for
    # --via clients), or --via PATH ARGV... (a client)
    if sys.argv[1] == "--via":
        via(sys.argv[2], sys.argv[3:])
    # sys.path as a fresh interpreter has it after its script's directory and PYTHONPATH
    start = 1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    path_after_start = sys.path[start:]
    # what Lightning imports (torch, its compiler front end, torchmetrics with SciPy and transformers), not
    # Lightning itself: its import reads the logging set-up the command has made by then (lightning.pytorch adds a
    # console handler of its own where the root logger has none; train.py imports it after Hydra's set-up)
    import torch._dynamo  # noqa: F401
    import torchmetrics  # noqa: F401

    if sys.argv[1] == "--listen":
        request, fds = serve([], listen(sys.argv[2]))
    else:
        request, fds = serve([socket.socket(fileno=int(sys.argv[1]))])
    become(request, fds, path_after_start)
