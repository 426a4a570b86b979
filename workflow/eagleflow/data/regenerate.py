"""Response regeneration: the target's own greedy replies replace the dataset's assistant turns.

A draft is judged by how often it guesses what the *target* says, so it should learn from the
target's outputs rather than from whoever wrote the dataset (the EAGLE-3 authors and SpecForge
regenerate responses the same way). Every conversation keeps its system and user turns; its
assistant turns are dropped and each user turn is answered by the target, greedily, through
vLLM (`LLM.generate`), with the target's own earlier replies in the context. Round r answers
the r-th user turn of every conversation of a chunk in one batched `generate` call.

The work is cut twice: the dataset into content-addressed source shards
(`eagleflow.data.sources`, one workflow job each), and a source shard into chunks of
conversations, each committed atomically once answered, so a killed job resumes after its
last committed chunk and computes the rest in the same batches (`regenerate_source_shard`).

Prompt-only datasets (a list of user turns per row: MT-Bench's `{"question_id", "turns"}`, or
`messages` without assistant turns) are read the same way and come out completed.

Sample ids are kept (the row's `id` / `question_id`, else the content hash of the row as read),
so the held-out split (`eagleflow.data.heldout`) is the same before and after regeneration.
A conversation whose first prompt is already `max_prompt_tokens` long has nothing left to
train on: it is a bad row (`data.on_bad_row`), named with its file and row.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eagleflow.data.conversations import BadRow, Conversation, DatasetError, read_conversations
from eagleflow.engine.settings import EngineSettings


def prompt_turns(messages) -> list[dict]:
    """A conversation's turns without its assistant turns."""
    return [
        {"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "assistant"
    ]


def regenerate_conversations(
    conversations: list[Conversation], generate, render, max_prompt_tokens: int, log=print
):
    """(rows, bad): `rows` are {"id", "messages"} with every user turn answered by `generate`.

    render(messages) -> prompt token ids (chat template plus generation prompt);
    generate(list of prompt token-id lists) -> list of reply texts, in order.
    A conversation stops (its later turns dropped) once its next prompt would be at least
    `max_prompt_tokens` long: sharding truncates there anyway.
    """
    pending = [prompt_turns(c.messages) for c in conversations]
    done: list[list[dict]] = [[] for _ in conversations]
    answered = [0] * len(conversations)
    stopped_early = 0
    rounds = 0
    while True:
        batch = []
        for i in range(len(conversations)):
            moved = []
            while pending[i]:
                m = pending[i].pop(0)
                moved.append(m)
                if m["role"] == "user":
                    break
            if not moved or moved[-1]["role"] != "user":
                continue  # nothing left to answer (trailing non-user turns are dropped)
            ids = render(done[i] + moved)
            if len(ids) >= max_prompt_tokens:
                stopped_early += bool(pending[i]) or answered[i] > 0
                pending[i] = []
                continue
            done[i] += moved
            batch.append((i, ids))
        if not batch:
            break
        t0 = time.time()
        replies = generate([ids for _, ids in batch])
        if len(replies) != len(batch):
            raise RuntimeError(f"generate returned {len(replies)} replies for {len(batch)} prompts")
        for (i, _), text in zip(batch, replies):
            done[i].append({"role": "assistant", "content": text})
            answered[i] += 1
        rounds += 1
        log(f"round {rounds}: {len(batch)} prompts answered in {time.time() - t0:.1f}s")
    rows, bad = [], []
    for c, msgs, n in zip(conversations, done, answered):
        if n == 0:
            bad.append(
                BadRow(
                    c.source_file,
                    c.source_row,
                    f"the first prompt is at least {max_prompt_tokens} tokens long: "
                    "nothing left for the target to answer",
                    c.sample_id,
                )
            )
            continue
        rows.append({"id": c.sample_id, "messages": msgs})
    stats = {
        "conversations": len(rows),
        "rounds": rounds,
        "replies": sum(answered),
        "stopped_early": stopped_early,
        "rejected": len(bad),
    }
    return rows, bad, stats


def start_generate_engine(settings: EngineSettings):
    """The engine regeneration answers with: no capture hooks, prefix caching on (a round's
    prompts extend the previous round's), CUDA graphs on GPUs (they speed up decoding; the CPU
    backend runs eager). A per-job generator and the shared engine server both build it here.

    `settings.max_num_seqs`: vLLM's cap on sequences decoded together (None: vLLM's default);
    one `generate` call hands vLLM a whole round, so on a CPU a larger cap means fewer, fuller
    decode steps. `settings.mla=False` builds the DeepSeek attention as `DeepseekV2Attention`
    (the latent `kv_a_proj_with_mqa` -> `kv_a_layernorm` -> `kv_b_proj` up-projection run at
    every step and full per-head K/V cached) instead of `DeepseekV2MLAAttention` (the latent
    cached, `kv_b_proj` absorbed into the query/output): the same weights and, on paper, the
    same function, decoded much faster by vLLM's CPU backend (docs/measurements/)."""
    from eagleflow.engine.builder import build_engine

    return build_engine(settings, eager=settings.device == "cpu")


def generate_replies(llm, prompts, max_new_tokens: int) -> list[tuple[str, str, int]]:
    """One batched greedy `LLM.generate` over prompt id lists: (text, finish reason, generated
    token count) per prompt, in order. Stops at the tokenizer's end-of-turn token or after
    `max_new_tokens`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts],
        params,
        use_tqdm=False,
    )
    return [
        (o.outputs[0].text, o.outputs[0].finish_reason, len(o.outputs[0].token_ids))
        for o in outputs
    ]


def counting_generator(replies_of):
    """generate(prompt id lists) -> reply texts over `replies_of` (prompts -> (text, finish
    reason, generated tokens) per prompt), and the finish counts it keeps. `generate.stats`
    sums the generated tokens and the seconds spent waiting for replies."""
    finished = {"stop": 0, "length": 0}

    def generate(prompts):
        t0 = time.time()
        replies = replies_of(prompts)
        for _, reason, n in replies:
            finished[reason] = finished.get(reason, 0) + 1
            generate.stats["generated_tokens"] += n
        generate.stats["generate_s"] += time.time() - t0
        return [text for text, _, _ in replies]

    generate.stats = {"generated_tokens": 0, "generate_s": 0.0}
    return generate, finished


def vllm_generator(settings: EngineSettings, max_new_tokens: int):
    """generate(prompt id lists) -> greedy reply texts through an engine of this job's own
    (`start_generate_engine`), and the finish counts. The shared engine server's client
    (eagleflow.extract.client, docs/engine-reuse.md) makes the same calls in the server."""
    llm = start_generate_engine(settings)
    return counting_generator(lambda prompts: generate_replies(llm, prompts, max_new_tokens))


def chat_renderer(tokenizer):
    def render(messages):
        out = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])

    return render


@dataclass(frozen=True)
class ShardFiles:
    """The three files a regenerate_shard job writes, each atomically."""

    rows: Path  # <id>.jsonl: {"id", "source": {"file", "row"}, "messages"} per kept row
    rejects: (
        Path  # <id>.rejects.jsonl: {"source_file", "source_row", "reason", "raw"}; empty if none
    )
    summary: Path  # <id>.summary.json: counts and throughput; written last

    @property
    def partial_dir(self) -> Path:
        return self.rows.parent / ".partial" / self.rows.name.split(".")[0]


def chunk_file(partial_dir: Path, i: int) -> Path:
    return Path(partial_dir) / f"chunk-{i:05d}.json"


def read_chunk(path: Path, shard_id: str, i: int, sample_ids: list[str]) -> dict | None:
    """A committed chunk of this shard holding exactly these conversations, else None."""
    try:
        chunk = json.loads(path.read_text(encoding="utf-8"))
        ok = chunk["shard"] == shard_id and chunk["chunk"] == i and chunk["samples"] == sample_ids
        return chunk if ok else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def reject_record(b: BadRow) -> dict:
    return {
        "source_file": b.source_file,
        "source_row": b.source_row,
        "reason": b.reason,
        "raw": b.raw,
    }


def jsonl(records) -> str:
    """JSON lines; nothing at all (not a blank line) for no records."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def regenerate_source_shard(
    dataset_path,
    manifest: dict,
    shard_id: str,
    target_dir,
    files: ShardFiles,
    max_length: int,
    max_new_tokens: int,
    chunk_rows: int,
    on_bad_row: str = "error",
    engine: EngineSettings | None = None,
    generate=None,
    generator=None,
    log=print,
) -> dict:
    """Regenerate one source shard (eagleflow.data.sources) of `dataset_path`.

    Its conversations are answered in chunks of `chunk_rows` conversations, in order; each
    chunk is its own set of rounds (its own `generate` calls) and is committed, once answered,
    to `.partial/<id>/chunk-NNNNN.json` (temporary name, then rename). A rerun after a kill
    keeps the committed chunks as they are and answers only the others, in the same batches an
    uninterrupted run uses: with greedy decoding the shard comes out the same. A job whose
    chunks are all committed loads no model and connects to no engine.

    `generator(settings, max_new_tokens) -> (generate, finish counts)` makes the generator when
    there are chunks to answer: `vllm_generator` (an engine of this job's own) by default, or
    the shared engine server's client (docs/engine-reuse.md), whose `generate.engine` says
    whether this job loaded the model. `generate` replaces vLLM altogether (tests)."""
    from eagleflow.data.sources import shard_entry, shard_raw_rows, source_shard_id

    t0 = time.time()
    entry = shard_entry(manifest, shard_id)
    if source_shard_id(manifest["identity"], shard_raw_rows(dataset_path, entry)) != shard_id:
        raise DatasetError(
            f"{dataset_path} changed after it was split into source shards (rows "
            f"{entry['first_row']}-{entry['last_row']} are not those of shard {shard_id}); "
            "run snakemake again to split it anew"
        )
    conversations, bad = read_conversations(
        dataset_path, require_assistant=False, rows=tuple(entry["rows"])
    )
    rows_read = len(conversations) + len(bad)
    if bad and on_bad_row == "error":
        raise DatasetError(f"{bad[0].message()} ({len(bad)} bad rows in this source shard)")
    chunks = [conversations[i : i + chunk_rows] for i in range(0, len(conversations), chunk_rows)]
    partial = files.partial_dir
    partial.mkdir(parents=True, exist_ok=True)
    done = {}
    for i, chunk in enumerate(chunks):
        found = read_chunk(chunk_file(partial, i), shard_id, i, [c.sample_id for c in chunk])
        if found is not None:
            done[i] = found
    todo = [i for i in range(len(chunks)) if i not in done]
    log(
        f"source shard {shard_id}: rows {entry['first_row']}-{entry['last_row']} of "
        f"{dataset_path}, {rows_read} rows, {len(conversations)} conversations in "
        f"{len(chunks)} chunks of up to {chunk_rows}; {len(done)} chunks already committed"
    )
    finished, started = None, 0.0
    # Whether this job paid a model load (vLLM unless a test passes its own `generate`) or was
    # served by a shared engine server that another job started.
    engine_info = {"server": False, "loaded_here": False, "server_pid": None}
    regenerated = {"replies": 0, "rounds": 0, "stopped_early": 0}
    if todo:
        from tqdm import tqdm

        from eagleflow.target.load import load_tokenizer

        render = chat_renderer(load_tokenizer(target_dir))
        t_engine = time.time()
        if generate is None:
            settings = engine or EngineSettings(
                str(target_dir), max_model_len=max_length + max_new_tokens
            )
            generate, finished = (generator or vllm_generator)(settings, max_new_tokens)
        engine_info = dict(
            getattr(generate, "engine", None) or {**engine_info, "loaded_here": True}
        )
        # Until the engine was ready: the load when this job paid it, else the connection.
        started = time.time() - t_engine
        bar = tqdm(
            total=len(conversations),
            initial=sum(len(chunks[i]) for i in done),
            unit="conv",
            desc=f"regenerate {shard_id}",
            mininterval=5,
        )
        stats = getattr(generate, "stats", None)

        def round_log(message):
            log(message)
            if stats and stats["generate_s"] > 0:
                bar.set_postfix_str(
                    f"{stats['generated_tokens'] / stats['generate_s']:.0f} generated tok/s"
                )

        for i in todo:
            rows, more_bad, chunk_stats = regenerate_conversations(
                chunks[i], generate, render, max_length, round_log
            )
            if more_bad and on_bad_row == "error":
                raise DatasetError(f"{more_bad[0].message()} ({len(more_bad)} such rows in all)")
            sources = {c.sample_id: (c.source_file, c.source_row) for c in chunks[i]}
            record = {
                "shard": shard_id,
                "chunk": i,
                "samples": [c.sample_id for c in chunks[i]],
                "rows": [
                    {
                        "id": r["id"],
                        "source": dict(zip(("file", "row"), sources[r["id"]])),
                        "messages": r["messages"],
                    }
                    for r in rows
                ],
                "rejects": [reject_record(b) for b in more_bad],
            }
            write_atomically(chunk_file(partial, i), json.dumps(record, ensure_ascii=False))
            done[i] = record
            for k in regenerated:
                regenerated[k] += chunk_stats[k]
            bar.update(len(chunks[i]))
        bar.close()
    # Assemble: the chunks' rows in order, one file, renamed into place; rejects sorted by row.
    rows = [r for i in range(len(chunks)) for r in done[i]["rows"]]
    rejects = sorted(
        [reject_record(b) for b in bad]
        + [r for i in range(len(chunks)) for r in done[i]["rejects"]],
        key=lambda r: r["source_row"],
    )
    if len(rows) + len(rejects) != rows_read:
        raise RuntimeError(
            f"source shard {shard_id}: {len(rows)} rows kept and {len(rejects)} rejected, "
            f"but {rows_read} read"
        )
    write_atomically(files.rows, jsonl(rows))
    write_atomically(files.rejects, jsonl(rejects))
    summary = {
        "shard": shard_id,
        "source": str(dataset_path),
        "first_row": entry["first_row"],
        "last_row": entry["last_row"],
        "rows_read": rows_read,
        "rows_kept": len(rows),
        "rows_rejected": len(rejects),
        "chunks": len(chunks),
        "chunks_resumed": len(chunks) - len(todo),
        "chunks_regenerated": len(todo),
        "model_loaded": engine_info["loaded_here"],
        "engine": engine_info,
        "replies": sum(len([m for m in r["messages"] if m["role"] == "assistant"]) for r in rows),
        "replies_now": regenerated["replies"],
        "rounds_now": regenerated["rounds"],
        "stopped_early_now": regenerated["stopped_early"],
        "finish_reasons_now": finished,
        "max_new_tokens": max_new_tokens,
        "max_length": max_length,
        "chunk_rows": chunk_rows,
        "seconds": round(time.time() - t0, 1),
        "engine_start_s": round(started, 1),
    }
    stats = getattr(generate, "stats", None)
    if stats and stats["generate_s"] > 0:
        summary.update(
            generated_tokens_now=stats["generated_tokens"],
            generate_s=round(stats["generate_s"], 1),
            tokens_per_second=round(stats["generated_tokens"] / stats["generate_s"], 1),
        )
    write_atomically(files.summary, json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(partial, ignore_errors=True)
    log(
        f"source shard {shard_id} done: {rows_read} rows read, {len(rows)} kept, "
        f"{len(rejects)} rejected; {summary['replies']} replies, {regenerated['replies']} "
        f"generated now ({len(todo)} of {len(chunks)} chunks; {len(chunks) - len(todo)} resumed)"
        + (
            f", {summary['tokens_per_second']} generated tok/s"
            if "tokens_per_second" in summary
            else ""
        )
        + f"; {summary['seconds']} s"
    )
    return summary
