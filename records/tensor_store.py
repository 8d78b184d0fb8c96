"""A compact, append-only array store for every snapshot's full tensors (``RUN_DIR/tensors/``).

W&B and the CSV get summaries on big models (:mod:`records.keys`); the store keeps every value,
so the end-of-run report (:mod:`reports.run_report`) and later analyses can read any pair's curve.
Numpy only, no extra dependency. Layout, per tensor name (names may contain ``/``):

    index.json           {"version": 1, "tensors": {name: {"file": stem, "shape": [...], "dtype": "float32"}}}
                         (and "labels": [...], the last axis' names, where the writer gave them)
    {stem}.f32           the values, one record of prod(shape) little-endian float32 per append
    {stem}.steps         the steps, one little-endian int64 per append

``stem`` is the name percent-encoded (``comp/K/frobenius`` -> ``comp%2FK%2Ffrobenius``): reversible,
collision-free and a single path component. Each name has its own steps, since some parts are
measured less often than others (the ablation, say), and steps strictly increase per name.

Crash safety: values are written before their step, each with one unbuffered ``write``; a reader
counts only records complete in both files, so a run killed mid-append loses at most that record,
and a writer reopening the store cuts such a torn tail off before appending. ``truncate_after``
drops records past a step, for resuming a killed run from an earlier checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import numpy as np

from records.layout import INDEX_NAME, DamagedFile

if TYPE_CHECKING:  # only for annotations: reading a store needs numpy alone, not torch
    from metrics.tracked.base import Output

"""The store's folder inside a run directory."""

VALUES_SUFFIX = ".f32"
STEPS_SUFFIX = ".steps"
VALUE_DTYPE = np.dtype("<f4")
STEP_DTYPE = np.dtype("<i8")


class TensorStore:
    """Appends ``{name: array}`` records to ``directory`` (created if missing).

    Opening repairs a torn last record of every name, so appends stay aligned; file handles stay
    open between appends (close with :meth:`close` or use the store as a context manager)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, dict] = _read_index(self.directory)
        self.last_steps: dict[str, int] = {}
        self._handles: dict[str, tuple] = {}
        for name, entry in self.entries.items():
            steps = _complete_steps(self.directory, entry)
            _cut_to(self.directory, entry, len(steps))
            if len(steps):
                self.last_steps[name] = int(steps[-1])

    def append(
        self, step: int, tensors: dict[str, np.ndarray], labels: dict[str, tuple[str, ...]] | None = None
    ) -> None:
        """Add one record per name at ``step``; each array is stored as float32 and must keep the
        shape its name was first stored with (and its last axis the ``labels`` it was first stored
        with, where given). Raises ValueError if ``step`` is not past a name's last stored step (on
        resume, call :meth:`truncate_after` first)."""
        labels = labels or {}
        arrays = {
            name: np.asarray(values, dtype=VALUE_DTYPE, order="C") for name, values in tensors.items()
        }  # 0-d stays 0-d
        for name, values in arrays.items():  # check everything before writing anything
            entry = self.entries.get(name)
            if entry is not None and name in labels and list(labels[name]) != entry.get("labels", list(labels[name])):
                # first: where the axis grew (a behaviour installed since), the names say why better than the shape
                raise ValueError(f"{name}: labels {list(labels[name])} differ from the stored {entry['labels']}")
            if entry is not None and tuple(entry["shape"]) != values.shape:
                raise ValueError(f"{name}: shape {values.shape} differs from the stored {tuple(entry['shape'])}")
            if name in self.last_steps and step <= self.last_steps[name]:
                raise ValueError(f"{name}: step {step} is not after the last stored step {self.last_steps[name]}")
        new = [name for name in arrays if name not in self.entries]
        if new:
            used = {entry["file"] for entry in self.entries.values()}
            for name in new:
                self.entries[name] = {
                    "file": _unique_stem(name, used),
                    "shape": list(arrays[name].shape),
                    "dtype": "float32",
                    **({"labels": list(labels[name])} if name in labels else {}),
                }
            _write_index(self.directory, self.entries)  # before any data file: every data file has an entry
        step_bytes = np.array([step], dtype=STEP_DTYPE).tobytes()
        for name, values in arrays.items():
            values_file, steps_file = self._files(name)
            values_file.write(values.tobytes())  # the values first: a step on disk means its values are
            steps_file.write(step_bytes)
            self.last_steps[name] = step

    def truncate_after(self, step: int) -> None:
        """Drop every record with a step greater than ``step``, of every name."""
        self.close()  # reopened on the next append, at the new end
        for name, entry in self.entries.items():
            steps = _complete_steps(self.directory, entry)
            keep = int(np.searchsorted(steps, step, side="right"))  # steps increase per name
            _cut_to(self.directory, entry, keep)
            if keep:
                self.last_steps[name] = int(steps[keep - 1])
            else:
                self.last_steps.pop(name, None)

    def close(self) -> None:
        for values_file, steps_file in self._handles.values():
            values_file.close()
            steps_file.close()
        self._handles.clear()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _files(self, name: str):
        if name not in self._handles:
            stem = self.directory / self.entries[name]["file"]
            # unbuffered: every write reaches the OS at once, so a killed process leaves whole records
            self._handles[name] = (
                open(f"{stem}{VALUES_SUFFIX}", "ab", buffering=0),
                open(f"{stem}{STEPS_SUFFIX}", "ab", buffering=0),
            )
        return self._handles[name]


def read_tensor_store(
    directory: str | Path, names: Iterable[str] | None = None, mmap: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{name: (steps int64 [n], values float32 [n, *shape])}`` of every complete record, for all
    names or only ``names`` (those not stored are left out). ``mmap``: values as read-only memory
    maps, not read into memory (a 12 × 12 run holds ~80 KB per pair tensor per snapshot)."""
    directory = Path(directory)
    entries = _read_index(directory)
    wanted = entries if names is None else [name for name in names if name in entries]
    out = {}
    for name in wanted:
        entry = entries[name]
        steps = _complete_steps(directory, entry)
        shape, size = tuple(entry["shape"]), _record_size(entry)
        path = _path(directory, entry, VALUES_SUFFIX)
        if not len(steps):
            values = np.empty((0, *shape), dtype=VALUE_DTYPE)
        elif mmap:
            values = np.memmap(path, dtype=VALUE_DTYPE, mode="r", shape=(len(steps), *shape))
        else:
            values = np.fromfile(path, dtype=VALUE_DTYPE, count=len(steps) * size).reshape(len(steps), *shape)
        out[name] = (steps, values)
    return out


def tensor_labels(directory: str | Path) -> dict[str, list[str]]:
    """``{name: labels}`` of every stored name whose last axis is labelled (:class:`~metrics.tracked.base.Stored`'s
    ``labels``); a store written before labels were kept has none."""
    return {name: entry["labels"] for name, entry in _read_index(Path(directory)).items() if "labels" in entry}


def snapshot_labels(outputs: list[Output]) -> dict[str, tuple[str, ...]]:
    """The labels of a snapshot's :class:`~metrics.tracked.base.Stored` arrays that have them, by name."""
    from metrics.tracked.base import Stored

    return {o.name: o.labels for o in outputs if isinstance(o, Stored) and o.labels is not None}


def snapshot_tensors(outputs: list[Output]) -> dict[str, np.ndarray]:
    """The tensors of a snapshot's outputs worth storing, by name: every :class:`PerHead` ``[L, H]``
    (``heads/induction``, ...), every :class:`PerPair` ``[L, H, L, H]`` it does not mark otherwise
    (``comp/K/frobenius``, ``match``, ``ablation/loss_change``: NaN where the reader is not later),
    every :class:`Stored` array (``comp/baseline/frobenius``: the baseline's mean and standard error)."""
    from metrics.tracked.base import PerHead, PerPair, Stored

    tensors = {}
    for output in outputs:
        if isinstance(output, Stored):
            tensors[output.name] = np.asarray(output.values)  # as given; float32 once appended
        elif isinstance(output, PerHead) or (isinstance(output, PerPair) and output.store):
            tensors[output.name] = _as_float32(output.values)
    return tensors


def _as_float32(values) -> np.ndarray:
    return values.detach().float().cpu().numpy() if hasattr(values, "detach") else np.asarray(values, dtype=VALUE_DTYPE)


def _read_index(directory: Path) -> dict[str, dict]:
    path = directory / INDEX_NAME
    if not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text())["tensors"])
    except (ValueError, KeyError, TypeError) as error:
        raise DamagedFile(path, error) from None


def _write_index(directory: Path, entries: dict[str, dict]) -> None:
    temporary = directory / f"{INDEX_NAME}.tmp"
    temporary.write_text(json.dumps({"version": 1, "tensors": entries}, indent=1))
    os.replace(temporary, directory / INDEX_NAME)  # atomic: a reader sees the old index or the new one


def _unique_stem(name: str, used: set[str]) -> str:
    """A file stem for ``name``: percent-encoded ("/" -> "%2F"; a stem of dots is harmless, a suffix
    follows). Quoting is one-to-one, but two names differing only in case would share files on a
    case-insensitive filesystem (macOS), so such a name gets a numbered stem."""
    stem = quote(name, safe="-_")
    folded = {u.lower() for u in used}
    if stem.lower() in folded:
        stem = next(f"{stem}~{i}" for i in range(1, len(used) + 2) if f"{stem}~{i}".lower() not in folded)
    used.add(stem)
    return stem


def _path(directory: Path, entry: dict, suffix: str) -> Path:
    return directory / f"{entry['file']}{suffix}"


def _record_size(entry: dict) -> int:
    return math.prod(entry["shape"])


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _complete_records(directory: Path, entry: dict) -> int:
    """Records complete in both files: a torn (partial) last record counts for nothing."""
    record_bytes = _record_size(entry) * VALUE_DTYPE.itemsize
    values = _size(_path(directory, entry, VALUES_SUFFIX)) // record_bytes if record_bytes else math.inf
    steps = _size(_path(directory, entry, STEPS_SUFFIX)) // STEP_DTYPE.itemsize
    return int(min(values, steps))


def _complete_steps(directory: Path, entry: dict) -> np.ndarray:
    count = _complete_records(directory, entry)
    if not count:
        return np.empty(0, dtype=STEP_DTYPE)
    return np.fromfile(_path(directory, entry, STEPS_SUFFIX), dtype=STEP_DTYPE, count=count)


def _cut_to(directory: Path, entry: dict, records: int) -> None:
    """Shorten both files of ``entry`` to ``records`` whole records (no-op on a missing file)."""
    for suffix, size in (
        (VALUES_SUFFIX, _record_size(entry) * VALUE_DTYPE.itemsize),
        (STEPS_SUFFIX, STEP_DTYPE.itemsize),
    ):
        path = _path(directory, entry, suffix)
        if path.is_file() and path.stat().st_size != records * size:
            os.truncate(path, records * size)
