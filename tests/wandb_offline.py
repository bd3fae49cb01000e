"""Reads an offline W&B run file (``run-<id>.wandb``) back: the run's config and its history rows.

wandb >= 0.18 writes runs from its Go core and no longer ships a Python reader. The file is a
LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each
``crc32 (4) | length (2) | type (1) | payload``; type 1 is a whole record, 2/3/4 first/middle/last
pieces. Each record is a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HEADER, BLOCK, CHUNK_HEADER = 7, 32 * 1024, 7
FULL, LAST = 1, 4


@dataclass
class OfflineRun:
    config: dict = field(default_factory=dict)
    """Every config key the run set (``wandb.config``), last value wins."""
    history: list[dict] = field(default_factory=list)
    """One dict per ``wandb.log`` call, keys as logged (plus W&B's ``_step``, ``_runtime``, ...)."""


def read_run(path: str | Path) -> OfflineRun:
    run = OfflineRun()
    for record in _records(Path(path).read_bytes()):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            run.config.update({u.key: json.loads(u.value_json) for u in updates})
        elif kind == "history":
            run.history.append({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.history.item})
    return run


def _records(data: bytes) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    pos, pieces = HEADER, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        pos += CHUNK_HEADER
        pieces += data[pos : pos + length]
        pos += length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record
