"""Integrity of finished outputs, checked cheaply on every invocation.

Before Snakemake decides what to run, every finished shard gets the cheap check (its size and
header against its extraction record). A shard that fails is moved, with its record and a
note of the reason, to `<hidden dir>/quarantine/`, so Snakemake sees it missing and
re-extracts it; nothing is deleted and nothing damaged is taken for finished.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .headers import cheap_check

SHARD_FILES = (".safetensors", ".json", ".verify.json")


def quarantine(hidden_dir: Path, shard_id: str, problems: list[str]) -> Path:
    dest = hidden_dir / "quarantine" / f"{shard_id}-{time.strftime('%Y%m%dT%H%M%S')}"
    dest.mkdir(parents=True, exist_ok=True)
    for suffix in SHARD_FILES:
        src = hidden_dir / f"{shard_id}{suffix}"
        if src.exists():
            os.replace(src, dest / src.name)
    (dest / "reason.txt").write_text("\n".join(problems) + "\n")
    return dest


def check_finished_shards(hidden_dir: str | Path, shard_ids, fingerprint: str, log=print) -> list[str]:
    """Cheap-check every shard that looks finished; quarantine the bad ones; return their ids."""
    hidden_dir = Path(hidden_dir)
    if not hidden_dir.is_dir():
        return []
    bad = []
    for shard_id in shard_ids:
        data, record_path = hidden_dir / f"{shard_id}.safetensors", hidden_dir / f"{shard_id}.json"
        if not data.exists() and not record_path.exists():
            continue  # not extracted yet
        try:
            record = json.loads(record_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            problems = [f"extraction record unreadable ({e})"]
        else:
            problems = cheap_check(data, record, fingerprint)
        if problems:
            dest = quarantine(hidden_dir, shard_id, problems)
            log(f"eagleflow: shard {shard_id} failed the integrity check ({'; '.join(problems)}); "
                f"moved to {dest} and scheduled for re-extraction")
            bad.append(shard_id)
    return bad
