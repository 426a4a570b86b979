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
        f"{plan['measured_engine_start_seconds']} s engine start per job "
        "(measured on finished shards)"
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


def regeneration_plan(sources: dict, regenerated_dir: str | Path, max_new_tokens: int) -> dict:
    """What regeneration still has to do: source shards done and to do, user turns to answer,
    chunks already committed, and an ETA from the finished shards' summaries (generated tokens
    per reply and per second, engine start); before any, replies are assumed max_new_tokens
    long and the ETA is unknown. Reads small JSON files only."""
    d = Path(regenerated_dir)
    done, summaries, todo_prompts, committed = 0, [], 0, 0
    for s in sources["shards"]:
        summary = d / f"{s['id']}.summary.json"
        if (d / f"{s['id']}.jsonl").exists() and summary.exists():
            done += 1
            summaries.append(json.loads(summary.read_text()))
        else:
            todo_prompts += s["prompts"]
            partial = d / ".partial" / s["id"]
            committed += len(list(partial.glob("chunk-*.json"))) if partial.is_dir() else 0
    measured = [r for r in summaries if r.get("replies_now") and r.get("tokens_per_second")]
    tok_s = per_reply = start_s = None
    if measured:
        generated = sum(r["generated_tokens_now"] for r in measured)
        tok_s = generated / sum(
            r["generated_tokens_now"] / r["tokens_per_second"] for r in measured
        )
        per_reply = generated / sum(r["replies_now"] for r in measured)
        start_s = sum(r["engine_start_s"] for r in measured) / len(measured)
    n_todo = len(sources["shards"]) - done
    tokens = todo_prompts * (per_reply or max_new_tokens)
    return {
        "source_shards_total": len(sources["shards"]),
        "source_shards_done": done,
        "source_shards_to_do": n_todo,
        "rows_total": sources["rows_read"],
        "prompts_to_do": todo_prompts,
        "chunks_committed_in_unfinished_shards": committed,
        "generated_tokens_to_do": round(tokens),
        "measured_tokens_per_second": round(tok_s, 1) if tok_s else None,
        "measured_tokens_per_reply": round(per_reply, 1) if per_reply else None,
        "measured_engine_start_seconds": round(start_s, 1) if start_s else None,
        "estimated_seconds": round(tokens / tok_s + n_todo * start_s, 1) if tok_s else None,
    }


def format_regeneration_plan(plan: dict) -> str:
    est = plan["estimated_seconds"]
    eta = (
        f"{est / 60:.1f} min at {plan['measured_tokens_per_second']} generated tok/s, "
        f"{plan['measured_tokens_per_reply']} tokens per reply and "
        f"{plan['measured_engine_start_seconds']} s engine start per job (measured)"
        if est is not None
        else "unknown until a source shard has been regenerated"
    )
    return "\n".join(
        [
            f"regeneration source shards: {plan['source_shards_total']} total, "
            f"{plan['source_shards_done']} done, {plan['source_shards_to_do']} to do "
            f"({plan['chunks_committed_in_unfinished_shards']} chunks already committed)",
            f"regeneration prompts to do: {plan['prompts_to_do']} of {plan['rows_total']} rows; "
            f"about {plan['generated_tokens_to_do']} tokens to generate",
            f"regeneration estimated time: {eta}",
        ]
    )
