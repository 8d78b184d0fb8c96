"""Copy everything a run prints (its report, warnings, errors and tracebacks) to ``RUN_DIR/train.log``."""

from __future__ import annotations

import io
import logging
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Tee(io.TextIOBase):
    """A text stream writing to ``stream`` and appending to ``log``. Progress-bar redraws (writes
    holding a carriage return) reach only the terminal: the log keeps lines, not 3,000 redraws."""

    def __init__(self, stream, log) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        if "\r" not in text and not self.log.closed:
            try:
                self.log.write(text)
            except OSError:  # a full disk: the terminal still gets every line, the log stops here
                self.stop_log()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        if not self.log.closed:
            try:
                self.log.flush()
            except OSError:
                self.stop_log()

    def stop_log(self) -> None:
        try:
            self.log.close()
        except OSError:  # closing flushes what is buffered: on a full disk it is lost, the file closed
            pass

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return self.stream.encoding


@contextmanager
def tee_console(path: Path) -> Iterator[None]:
    """Within the block, ``sys.stdout``, ``sys.stderr`` and the logging handlers writing to them also
    append to ``path`` (line-buffered, so a killed run's log ends where its console did). Restored
    after it: the jobs of a sweep that share a process each get only their own output."""
    log = open(path, "a", buffering=1, encoding="utf-8")
    stdout, stderr = sys.stdout, sys.stderr
    tees = {id(stdout): Tee(stdout, log), id(stderr): Tee(stderr, log)}
    handlers = [
        h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler) and id(h.stream) in tees
    ]
    streams = [h.stream for h in handlers]  # Hydra's console handler holds the original stream
    for handler in handlers:
        handler.setStream(tees[id(handler.stream)])
    sys.stdout, sys.stderr = tees[id(stdout)], tees[id(stderr)]
    try:
        yield
    except Exception:
        if not log.closed:
            try:
                log.write(traceback.format_exc())  # the error that ends the run, in its log (Python prints it)
            except OSError:
                pass  # a full disk: the console has it
        raise
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        for handler, stream in zip(handlers, streams):
            handler.setStream(stream)
        try:
            log.close()
        except OSError:  # its last buffered line, on a full disk
            pass


HYDRA_NOISE = (
    "Set the environment variable HYDRA_FULL_ERROR",
    "To append to your config use",
    "reference_type=",
    "object_type=",
)


def one_line(report: str) -> str:
    """Hydra's multi-line report of a bad command line, as one line: the message, the key, the
    options to choose from; not the search path or the hint about ``HYDRA_FULL_ERROR``."""
    parts: list[str] = []
    in_search_path = False
    for raw in report.splitlines():
        line = raw.strip()
        if line.startswith("Config search path"):
            in_search_path = True
        if not line or in_search_path or line.startswith(HYDRA_NOISE):
            continue
        if line.startswith("full_key:") and parts:
            parts[-1] += f" (key {line.split(':', 1)[1].strip()})"
        elif raw.startswith("\t") and parts and parts[-1].endswith((":", ",")):
            parts[-1] += f" {line},"  # an option listed under "Available options in 'model':"
        else:
            parts.append(line)
    return " ".join(part.rstrip(",") for part in parts)


SWEEPS_PLUGINS = (
    "hydra/launcher/joblib",
    "hydra/launcher/submitit_local",
    "hydra/launcher/submitit_slurm",
    "hydra/sweeper/optuna",
)
SWEEPS_INSTALL = "pip install -e '.[sweeps]'"  # pyproject.toml's extra of Hydra's launcher and sweeper plugins


def with_install_hint(message: str) -> str:
    """``message``, and when it is Hydra's "Could not find" of a launcher or sweeper that the ``sweeps``
    extra installs, the command that installs it (the core install leaves the extras out)."""
    missing = next((plugin for plugin in SWEEPS_PLUGINS if f"Could not find '{plugin}'" in message), None)
    if missing is None:
        return message
    return f"{message}; {missing.rsplit('/', 1)[-1]} comes with the 'sweeps' extra: {SWEEPS_INSTALL}"


def with_hints(message: str) -> str:
    """``message`` with the install hint (:func:`with_install_hint`) and, for a key Hydra could not
    override, the closest key there is (``conf.validate.did_you_mean``)."""
    import re

    message = with_install_hint(message)
    if found := re.match(r"Could not override '([\w.]+)'", message):
        from conf.validate import did_you_mean

        message += did_you_mean(found.group(1))
    return message


def release_startup_errors() -> None:
    """Let stderr through again: Hydra has composed the config (called by the first Hydra callback,
    and by train.py's main)."""
    if HOLDING is not None:
        HOLDING.release()


class StartupErrors:
    """Hold what is printed to stderr before ``train.py``'s main starts (Hydra composing the config),
    so that a bad command line ends in one line of error, not Hydra's 6-15. ``release()``, called
    first thing in main, lets stderr through again (and what was held, verbatim)."""

    def __init__(self) -> None:
        self.stderr, self.held = sys.stderr, io.StringIO()

    def __enter__(self) -> StartupErrors:
        global HOLDING
        sys.stderr, HOLDING = self.held, self
        return self

    def release(self) -> None:
        if sys.stderr is self.held:
            sys.stderr = self.stderr
            self.stderr.write(self.held.getvalue())

    def __exit__(self, kind, error, traceback) -> None:
        if sys.stderr is not self.held:
            return
        sys.stderr = self.stderr
        text = self.held.getvalue()
        failed = kind is SystemExit and error.code not in (0, None)
        hydra_report = failed and text.strip() and "Traceback (most recent call last)" not in text
        self.stderr.write(f"config error: {with_hints(one_line(text))}\n" if hydra_report else text)

    def __getstate__(self) -> dict:
        return {}  # a sweep launcher pickles main with its globals: a job's copy holds nothing

    def __setstate__(self, state: dict) -> None:
        self.stderr, self.held = sys.stderr, io.StringIO()


HOLDING: StartupErrors | None = None  # the StartupErrors holding stderr now, if any
