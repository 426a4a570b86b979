"""Integrity of finished outputs, checked cheaply on every invocation.

Before Snakemake decides what to run, every finished shard gets the cheap check (its size and
header against its extraction record). A shard that fails is moved, with its record and a
note of the reason, to `<hidden dir>/quarantine/`, so Snakemake sees it missing and
re-extracts it; nothing is deleted and nothing damaged is taken for finished.

A missing shard alone is not enough: Snakemake re-runs a job whose output is missing only
when something downstream needs it, and the verification summary downstream still exists and
is up to date by mtime. So whenever a shard of the current set lacks any of its files, the
summary (a table derived from every shard, cheap to rebuild) is moved aside too.

The token shards get the same treatment one level up: the shard checkpoint's manifest lists
them, and Snakemake takes the checkpoint for done while the manifest exists, so a token shard
deleted by hand would leave its extraction job without an input. A manifest that lists a
missing token shard (or cannot be read) is moved aside, and the checkpoint re-shards.

Two things are never touched: a shard whose extract job holds its lock
(`<hidden dir>/.partial/<shard>/lock`, `eagleflow.extract.shard.shard_lock`: between the
link into place and the record, a running job's shard looks unfinished), and anything at all
in a dry run (`snakemake -n`), which only reports what a real run would move. The manifest
is the exception: a dry run moves it aside too, since no job writes a manifest that lists a
missing token shard and without the move the dry run cannot plan at all (the extraction jobs
would lack their input).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from eagleflow.store.headers import cheap_check
from eagleflow.store.locks import held_by_another

SHARD_FILES = (".safetensors", ".json", ".verify.json")
SUMMARY_FILES = ("verify_summary.tsv", "manifest.parquet")


def _move_aside(hidden_dir: Path, name: str, files: list[Path], problems: list[str]) -> Path:
    dest = hidden_dir / "quarantine" / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}"
    dest.mkdir(parents=True, exist_ok=True)
    for src in files:
        if src.exists():
            os.replace(src, dest / src.name)
    (dest / "reason.txt").write_text("\n".join(problems) + "\n")
    return dest


def quarantine(hidden_dir: Path, shard_id: str, problems: list[str]) -> Path:
    return _move_aside(
        hidden_dir, shard_id, [hidden_dir / f"{shard_id}{s}" for s in SHARD_FILES], problems
    )


def set_aside_stale_summary(
    hidden_dir: Path, shard_ids, log=print, dry_run: bool = False
) -> Path | None:
    """Move the summary aside when any shard of the current set lacks one of its files (in a
    dry run: say so)."""
    summary = [hidden_dir / name for name in SUMMARY_FILES]
    if not any(p.exists() for p in summary):
        return None
    names = set(os.listdir(hidden_dir))
    unfinished = [
        s for s in shard_ids if any(f"{s}{suffix}" not in names for suffix in SHARD_FILES)
    ]
    if not unfinished:
        return None
    if dry_run:
        log(
            f"eagleflow: {len(unfinished)} shard(s) to extract or verify (first: "
            f"{unfinished[0]}); a run would move the verification summary aside (dry run: kept)"
        )
        return None
    dest = _move_aside(
        hidden_dir,
        "summary",
        summary,
        [f"shard {s} is not finished (extraction or verification missing)" for s in unfinished],
    )
    log(
        f"eagleflow: {len(unfinished)} shard(s) to extract or verify (first: {unfinished[0]}); "
        f"the verification summary was moved to {dest} and will be rebuilt"
    )
    return dest


def check_finished_shards(
    hidden_dir: str | Path, shard_ids, fingerprint: str, log=print, dry_run: bool = False
) -> list[str]:
    """Cheap-check every shard that looks finished and whose job is not running; quarantine
    the bad ones (and set a stale summary aside); return their ids. `dry_run`: report only."""
    hidden_dir = Path(hidden_dir)
    if not hidden_dir.is_dir():
        return []
    bad = []
    for shard_id in shard_ids:
        data, record_path = hidden_dir / f"{shard_id}.safetensors", hidden_dir / f"{shard_id}.json"
        if not data.exists() and not record_path.exists():
            continue  # not extracted yet
        if held_by_another(hidden_dir / ".partial" / shard_id / "lock"):
            continue  # its job runs: between its link into place and its record
        try:
            record = json.loads(record_path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError, RecursionError) as e:
            problems = [f"extraction record unreadable ({e})"]
        else:
            problems = cheap_check(data, record, fingerprint)
        if problems and dry_run:
            log(
                f"eagleflow: shard {shard_id} fails the integrity check ({'; '.join(problems)}); "
                "a run would quarantine it and extract it again (dry run: left in place)"
            )
            bad.append(shard_id)
        elif problems:
            dest = quarantine(hidden_dir, shard_id, problems)
            log(
                f"eagleflow: shard {shard_id} failed the integrity check ({'; '.join(problems)}); "
                f"moved to {dest} and scheduled for re-extraction"
            )
            bad.append(shard_id)
    set_aside_stale_summary(hidden_dir, shard_ids, log=log, dry_run=dry_run)
    return bad


def set_aside_incomplete_manifest(shards_dir: str | Path, log=print) -> Path | None:
    """Move `<shards_dir>/manifest.parquet` to `<shards_dir>/quarantine/` when a token shard it
    lists is missing from `<shards_dir>/tokens/` (or the manifest is unreadable), so that the
    shard checkpoint runs again; return where it went."""
    import pyarrow.parquet as pq

    shards_dir = Path(shards_dir)
    manifest = shards_dir / "manifest.parquet"
    if not manifest.exists():
        return None
    try:
        ids = set(pq.read_table(manifest, columns=["shard_id"]).column("shard_id").to_pylist())
    except (OSError, ValueError, KeyError) as e:  # re-shard rather than fail later
        problems, missing = [f"{manifest} is unreadable ({type(e).__name__}: {e})"], []
    else:
        tokens = shards_dir / "tokens"
        names = set(os.listdir(tokens)) if tokens.is_dir() else set()
        missing = sorted(s for s in ids if f"{s}.safetensors" not in names)
        problems = [f"token shard {s}.safetensors is missing" for s in missing]
    if not problems:
        return None
    dest = _move_aside(shards_dir, "manifest", [manifest], problems)
    what = (
        f"{len(missing)} token shard(s) listed in {manifest} are missing (first: {missing[0]})"
        if missing
        else problems[0]
    )
    log(f"eagleflow: {what}; the manifest was moved to {dest} and the data will be sharded again")
    return dest
