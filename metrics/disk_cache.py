"""Results that are pure functions of their inputs (the composition measures' random baselines, the
head behaviours' random-attention null), kept on disk so that a run pays for each once per machine.

Files are JSON, written atomically (a temporary file in the same folder renamed over the target) so
that concurrent sweep jobs can share the folder; a missing, torn or unreadable file is recomputed,
and a folder that cannot be written only costs the saving (a warning, the result still returned).
JSON keeps a float64 exactly (Python writes the shortest repr that reads back to the same double).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

CACHE_ENV = "INDUCTION_TRACKER_CACHE"


def cache_directory() -> Path:
    """``$INDUCTION_TRACKER_CACHE``, else ``$XDG_CACHE_HOME/induction-composition-tracker``, else
    ``~/.cache/induction-composition-tracker``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "induction-composition-tracker"


def cache_file(kind: str, name: str) -> Path:
    """Where the result ``name`` of ``kind`` (``baselines``, ``behaviour_nulls``) is kept."""
    return cache_directory() / kind / f"{name}.json"


def read_json(path: Path) -> Any | None:
    """What ``path`` holds, or None where it is missing or torn by a crash (recompute)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: Any, what: str) -> None:
    """``value`` as JSON in ``path``, atomically; where the folder cannot be written (a read-only
    home, say), a warning naming ``what`` was not kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            json.dump(value, handle)
        os.replace(handle.name, path)
    except OSError as error:
        warnings.warn(f"could not cache {what} in {path.parent}: {error}", stacklevel=3)
