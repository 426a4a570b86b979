"""Reading safetensors headers, hashing files, and the cheap integrity check: what runs on
every invocation, so it imports neither torch nor numpy."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


def read_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header and the byte offset where data starts (reads only the header)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path}: implausible header length {n}")
        blob = f.read(n)
        if len(blob) != n:
            raise ValueError(f"{path}: truncated header")
    return json.loads(blob), 8 + n


def foreign_header(header) -> str | None:
    """What makes `header` not a safetensors header (a dict of tensor entries, each a dict
    with two integer data offsets, and a dict of str metadata); None when it is one."""
    if not isinstance(header, dict):
        return f"a JSON {type(header).__name__}, not an object"
    for k, v in header.items():
        if k == "__metadata__":
            if not isinstance(v, dict):
                return "__metadata__ is not an object"
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
        ):
            return f"entry {k!r} has no [start, end] data offsets"
    return None


def file_sha256(path: str | Path, block: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def cheap_check(path: str | Path, record: dict, fingerprint: str) -> list[str]:
    """Problems found from size and header alone (empty list = passes)."""
    path = Path(path)
    problems = []
    if not path.is_file():
        return [f"{path}: missing"]
    size = path.stat().st_size
    if size != record.get("bytes"):
        problems.append(
            f"size {size} bytes, the extraction record says {record.get('bytes')} (truncated or "
            "replaced)"
        )
    try:
        header, data_start = read_header(path)
    except (ValueError, OSError, RecursionError) as e:
        return problems + [f"unreadable header: {e}"]
    foreign = foreign_header(header)
    if foreign:
        return problems + [f"not a safetensors header: {foreign}"]
    meta = header.get("__metadata__", {})
    if meta.get("fingerprint") != fingerprint:
        problems.append(
            f"fingerprint {meta.get('fingerprint')!r} in the file, expected {fingerprint!r} (a "
            "file from another configuration)"
        )
    if meta.get("shard_id") != record.get("shard_id"):
        problems.append(
            f"shard id {meta.get('shard_id')!r} in the file, expected {record.get('shard_id')!r}"
        )
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if ends and data_start + max(ends) != size:
        problems.append(f"header describes {data_start + max(ends)} bytes, file has {size}")
    return problems
