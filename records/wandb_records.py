"""Read a W&B offline run file (``run-*.wandb``) back, independently of the wandb client (whose
Python reader went into its Go core). The sweep report reads runs known only by their W&B files
with it; the tests check with it what a run logged.

The file is a LevelDB-style log (32 KiB blocks; each record chunk has a 7-byte header of
crc32, length and type FULL/FIRST/MIDDLE/LAST) after a 7-byte ``:W&B`` file header; every
record is a protobuf ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending, out = 7, b"", []
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:
            pos += left  # block trailer padding
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        pos += HEADER.size
        if kind == 0 and length == 0:
            pos += left - HEADER.size
            continue
        chunk, pos = data[pos : pos + length], pos + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    parsed = []
    for raw in out:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def history(path: Path) -> list[dict[str, object]]:
    """Every ``wandb.log`` row of the run, keys to decoded JSON values."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def config(path: Path) -> dict[str, object]:
    """The run's config, merged over all its config records."""
    merged: dict[str, object] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            merged[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return merged


def summary(path: Path) -> dict[str, object]:
    """The run's final summary (the last value written for each key)."""
    merged: dict[str, object] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                merged[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return merged


def exit_code(path: Path) -> int | None:
    """The exit code the run finished with (0: marked successful), or None if it never finished."""
    codes = [record.exit.exit_code for record in records(path) if record.WhichOneof("record_type") == "exit"]
    return codes[-1] if codes else None


def run_id(path: Path) -> str:
    """The W&B run id the file records."""
    return next(record.run.run_id for record in records(path) if record.WhichOneof("record_type") == "run")
