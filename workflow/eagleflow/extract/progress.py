"""What an extraction run still has to do: shards, tokens, bytes and time, from the manifest
and the records of the shards already done. Reads no tensors and loads no model. The time is
estimated from what finished jobs measured (extract.rates.measure, as the SLURM time limits)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from eagleflow.extract.rates import extraction_timings, measure, regeneration_timings
from eagleflow.store.quant import DEFAULT_STORAGE, bytes_per_token


def _rounded(x: float | None) -> float | None:
    return round(x, 1) if x else None


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
    done = [
        shard_id
        for shard_id in per_shard.index
        if (hidden_dir / f"{shard_id}.safetensors").exists()
        and (hidden_dir / f"{shard_id}.json").exists()
    ]
    todo_tokens = int(per_shard.drop(done).sum())
    per_token = bytes_per_token(n_layers, hidden_size, dtype, storage_dtype)
    measured = measure(extraction_timings(hidden_dir))
    n_todo = len(per_shard) - len(done)
    return {
        "shards_total": int(len(per_shard)),
        "shards_done": len(done),
        "shards_to_do": n_todo,
        "tokens_total": int(per_shard.sum()),
        "tokens_to_do": todo_tokens,
        "bytes_to_write": todo_tokens * per_token,
        "measured_tokens_per_second": _rounded(measured.tokens_per_second),
        "measured_load_seconds": _rounded(measured.load_seconds),
        "measured_loads_per_job": measured.loads_per_job,
        "estimated_seconds": _rounded(measured.seconds(todo_tokens, n_todo)),
    }


def _loads(plan: dict) -> str:
    share = plan["measured_loads_per_job"]
    if not share:
        return "no model load measured"
    per = "every job" if share == 1 else f"{share:.2f} of the jobs"
    return f"a {plan['measured_load_seconds']} s model load in {per}"


def format_progress(plan: dict) -> str:
    est = plan["estimated_seconds"]
    eta = (
        f"{est / 60:.1f} min at {plan['measured_tokens_per_second']} tok/s and "
        f"{_loads(plan)} (measured on finished shards)"
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
    per reply; rate and model load as extract.rates.measure); before any, replies are assumed
    max_new_tokens long and the ETA is unknown. Reads small JSON files only."""
    d = Path(regenerated_dir)
    done, todo_prompts, committed, generated, replies = 0, 0, 0, 0, 0
    for s in sources["shards"]:
        summary = d / f"{s['id']}.summary.json"
        if (d / f"{s['id']}.jsonl").exists() and summary.exists():
            done += 1
            record = json.loads(summary.read_text())
            if record.get("replies_now") and record.get("generated_tokens_now"):
                generated += record["generated_tokens_now"]
                replies += record["replies_now"]
        else:
            todo_prompts += s["prompts"]
            partial = d / ".partial" / s["id"]
            committed += len(list(partial.glob("chunk-*.json"))) if partial.is_dir() else 0
    measured = measure(regeneration_timings(d))
    per_reply = generated / replies if replies else None
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
        "measured_tokens_per_second": _rounded(measured.tokens_per_second),
        "measured_tokens_per_reply": _rounded(per_reply),
        "measured_load_seconds": _rounded(measured.load_seconds),
        "measured_loads_per_job": measured.loads_per_job,
        "estimated_seconds": _rounded(measured.seconds(tokens, n_todo)),
    }


def format_regeneration_plan(plan: dict) -> str:
    est = plan["estimated_seconds"]
    eta = (
        f"{est / 60:.1f} min at {plan['measured_tokens_per_second']} generated tok/s, "
        f"{plan['measured_tokens_per_reply']} tokens per reply and "
        f"{_loads(plan)} (measured)"
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
