"""Source shards: the dataset cut into content-addressed pieces for regeneration.

A source shard is `shard_rows` consecutive rows of `data.path` in dataset order (blank JSONL
lines are not rows). Its id hashes the rows as read (their bytes, bad rows included), the
target's identity (the extraction fingerprint's target part: config.json, tokenizer and chat
template files, weight signatures), the generation settings (`max_new_tokens`, `max_length`,
`mla`) and REGENERATION_CODE_VERSION. So appending rows adds shards and leaves the finished
ones alone, editing a row changes its own shard's id only, and a new target or new settings
regenerate everything. One `regenerate_shard` job per id writes
`results/regenerated/<id>.jsonl` (eagleflow.regenerate.shard).

The split is a cheap pass over the file (no tokenizer, no model); its manifest
(`results/regenerated/sources.json`) lists the shards in dataset order with their row range
and the number of user turns to answer, which sizes each job on a cluster.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eagleflow.data.conversations import DatasetError, _records, jsonl_lines, normalize_messages

# Bump when the regeneration code changes what is written for the same rows.
REGENERATION_CODE_VERSION = 1


def regeneration_identity(
    target_identity: dict,
    max_new_tokens: int,
    max_length: int,
    mla: bool,
    chat_template_kwargs: dict | None = None,
    reasoning_parser: str | None = None,
    on_truncated: str = "keep",
    tool_parser: str | None = None,
) -> dict:
    """What, besides the rows, decides a source shard's replies (`data.chat_template_kwargs`,
    `data.regenerate.reasoning_parser`, `on_truncated` and `tool_parser` only when set: the ids
    of shards made before the keys existed stay as they were)."""
    identity = {
        "target": target_identity,
        "max_new_tokens": int(max_new_tokens),
        "max_length": int(max_length),
        "mla": bool(mla),
        "regeneration_code_version": REGENERATION_CODE_VERSION,
    }
    if chat_template_kwargs:
        identity["chat_template_kwargs"] = dict(chat_template_kwargs)
    if reasoning_parser:
        identity["reasoning_parser"] = reasoning_parser
    if on_truncated != "keep":
        identity["on_truncated"] = on_truncated
    if tool_parser:
        identity["tool_parser"] = tool_parser
    return identity


def raw_rows(path: str | Path) -> list[tuple[int, bytes]]:
    """(row number, bytes as read) of every row: JSONL lines undecoded (a line that is not UTF-8
    is still a row: the regenerate job rejects it by name); JSON and Parquet records as JSON."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: dataset file not found; set `data.path` in the config")
    if path.suffix.lower() == ".jsonl":
        return list(jsonl_lines(path))
    return [(row, raw.encode()) for row, _, raw in _records(path)]


def user_turns(raw: bytes) -> int:
    """User turns a regeneration job answers for one row (0 for a bad row); for job sizing."""
    try:
        record = json.loads(raw.decode("utf-8"))
        messages = normalize_messages(record, require_assistant=False)
    except (ValueError, AttributeError, TypeError):
        return 0
    return sum(m["role"] == "user" for m in messages)


def source_shard_id(identity: dict, rows: list[bytes]) -> str:
    h = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for raw in rows:
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()[:20]


def split_sources(path: str | Path, identity: dict, shard_rows: int) -> dict:
    """The source shards of a dataset, in dataset order (the manifest's content)."""
    rows = raw_rows(path)
    if not rows:
        raise DatasetError(f"{path}: the dataset holds no rows")
    shards = []
    for start in range(0, len(rows), shard_rows):
        part = rows[start : start + shard_rows]
        shards.append(
            {
                "id": source_shard_id(identity, [raw for _, raw in part]),
                "rows": [start, start + len(part)],
                "first_row": part[0][0],
                "last_row": part[-1][0],
                "prompts": sum(user_turns(raw) for _, raw in part),
            }
        )
    # Two shards of identical rows share an id and one file; sharding reads it once per shard
    # and rejects the second copy's rows as duplicate sample ids, so every row is accounted for.
    return {"source": str(path), "rows_read": len(rows), "identity": identity, "shards": shards}


def write_manifest(manifest: dict, out_path: str | Path) -> None:
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out_path)


def read_manifest(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def shard_entry(manifest: dict, shard_id: str) -> dict:
    for s in manifest["shards"]:
        if s["id"] == shard_id:
            return s
    raise KeyError(f"source shard {shard_id} is not in the current split of {manifest['source']}")


def shard_raw_rows(path: str | Path, entry: dict) -> list[bytes]:
    start, end = entry["rows"]
    return [raw for _, raw in raw_rows(path)[start:end]]
