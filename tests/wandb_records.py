"""Read an offline W&B run file (`run-<id>.wandb`) back into its protobuf records.

wandb 0.31 has no Python reader for these files any more (its reader lives in wandb-core), so
this does the framing: the file is a ":W&B" header (7 bytes) followed by a LevelDB-style log
of 32 KiB blocks, each record chunk behind a 7-byte header (crc32c, little-endian length,
type: 1 full, 2 first, 3 middle, 4 last). The chunks are decoded with wandb's own protobuf
schema, `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7


def read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: too short for a header, zero-filled
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0:
            continue
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    return [wandb_internal_pb2.Record.FromString(c) for c in out]


def summarize(records) -> dict:
    """{'run': RunRecord, 'config': {...}, 'history': [{...}], 'summary': {...}, 'artifacts': [...]}"""
    out = {"run": None, "config": {}, "history": [], "summary": {}, "artifacts": []}

    def key_of(item):
        return "/".join(item.nested_key) if item.nested_key else item.key

    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = r.run
            for item in r.run.config.update:
                out["config"][key_of(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in r.config.update:
                out["config"][key_of(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({key_of(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            for item in r.summary.update:
                out["summary"][key_of(item)] = json.loads(item.value_json)
        elif kind == "artifact":
            out["artifacts"].append(r.artifact)
    return out
