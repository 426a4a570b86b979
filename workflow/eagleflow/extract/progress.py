"""What an extraction run still has to do: shards, tokens, bytes and time, from the manifest
and the records of the shards already done. Reads no tensors and loads no model."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from eagleflow.store.quant import DEFAULT_STORAGE, bytes_per_token


def extraction_progress(
    manifest: pd.DataFrame,
    hidden_dir: str | Path,
    n_layers: int,
    hidden_size: int,
    dtype: str,
    storage_dtype: str = DEFAULT_STORAGE,
) -> dict:
    hidden_dir = Path(hidden_dir)
    per_shard = manifest.groupby("shard_id", sort=True)["n_tokens"].sum()
    done, records = [], []
    for shard_id in per_shard.index:
        record_path = hidden_dir / f"{shard_id}.json"
        if (hidden_dir / f"{shard_id}.safetensors").exists() and record_path.exists():
            done.append(shard_id)
            records.append(json.loads(record_path.read_text()))
    todo_tokens = int(per_shard.drop(done).sum())
    per_token = bytes_per_token(n_layers, hidden_size, dtype, storage_dtype)
    measured = [r for r in records if r.get("tokens_extracted_now") and r.get("tokens_per_second")]
    tok_s = (
        (
            sum(r["tokens_extracted_now"] for r in measured)
            / sum(r["tokens_extracted_now"] / r["tokens_per_second"] for r in measured)
        )
        if measured
        else None
    )
    start_s = (
        (sum(r["seconds"]["engine_start"] for r in measured) / len(measured)) if measured else None
    )
    n_todo = len(per_shard) - len(done)
    return {
        "shards_total": int(len(per_shard)),
        "shards_done": len(done),
        "shards_to_do": n_todo,
        "tokens_total": int(per_shard.sum()),
        "tokens_to_do": todo_tokens,
        "bytes_to_write": todo_tokens * per_token,
        "measured_tokens_per_second": round(tok_s, 1) if tok_s else None,
        "measured_engine_start_seconds": round(start_s, 1) if start_s else None,
        "estimated_seconds": round(todo_tokens / tok_s + n_todo * start_s, 1) if tok_s else None,
    }


def format_progress(plan: dict) -> str:
    est = plan["estimated_seconds"]
    eta = (
        f"{est / 60:.1f} min at {plan['measured_tokens_per_second']} tok/s and "
        f"{plan['measured_engine_start_seconds']} s engine start per job (measured on finished "
        "shards)"
        if est is not None
        else "unknown until a shard has been extracted"
    )
    return "\n".join(
        [
            f"shards: {plan['shards_total']} total, {plan['shards_done']} done, "
            f"{plan['shards_to_do']} to do",
            f"tokens: {plan['tokens_total']} total, {plan['tokens_to_do']} to do",
            f"bytes to write: {plan['bytes_to_write'] / 2**30:.3f} GiB",
            f"estimated time: {eta}",
        ]
    )
