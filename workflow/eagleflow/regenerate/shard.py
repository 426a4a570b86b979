"""One regenerate_shard job: a source shard's conversations answered, committed in chunks.

The work is cut twice: the dataset into content-addressed source shards
(`eagleflow.regenerate.sources`, one workflow job each), and a source shard into chunks of
conversations, each committed atomically once answered, so a killed job resumes after its
last committed chunk and computes the rest in the same batches (`regenerate_source_shard`:
`load_chunks`, `answer_chunks`, `assemble`). The replies come from the job's `Generator`
(eagleflow.regenerate.replies).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagleflow.data.conversations import BadRow, Conversation, DatasetError, read_conversations
from eagleflow.regenerate.replies import (
    Generator,
    ReplyForm,
    chat_renderer,
    conversation_renderer,
    reasoning_splitter,
    regenerate_conversations,
    tool_splitter,
)
from eagleflow.regenerate.sources import shard_entry, shard_raw_rows, source_shard_id


@dataclass(frozen=True)
class Regeneration:
    """How a regenerate_shard job answers its source shard (from the config)."""

    target: str | Path  # target.path: its tokenizer renders the prompts
    max_length: int  # data.max_length: a conversation stops once its next prompt is this long
    max_new_tokens: int  # data.regenerate.max_new_tokens: most tokens per reply
    chunk_rows: int  # data.regenerate.chunk_rows: conversations per committed chunk
    on_bad_row: str = "error"  # data.on_bad_row: "error" stops the job, "skip" rejects the row
    chat_template_kwargs: dict = field(default_factory=dict)  # data.chat_template_kwargs
    reasoning_parser: str | None = None  # data.regenerate.reasoning_parser: vLLM's, by name
    on_truncated: str = "keep"  # data.regenerate.on_truncated: keep | drop a reply cut short
    tool_parser: str | None = None  # data.regenerate.tool_parser: vLLM's, by name

    @property
    def keeps_special_tokens(self) -> bool:
        """Replies keep their markers (`</think>`, tool-call sections) for the parsers to split,
        and are checked to render back to their generated ids."""
        return self.reasoning_parser is not None or self.tool_parser is not None

    @classmethod
    def from_config(cls, config: dict) -> Regeneration:
        data = config["data"]
        return cls(
            config["target"]["path"],
            max_length=data["max_length"],
            max_new_tokens=data["regenerate"]["max_new_tokens"],
            chunk_rows=data["regenerate"]["chunk_rows"],
            on_bad_row=data["on_bad_row"],
            chat_template_kwargs=dict(data["chat_template_kwargs"]),
            reasoning_parser=data["regenerate"]["reasoning_parser"],
            on_truncated=data["regenerate"]["on_truncated"],
            tool_parser=data["regenerate"]["tool_parser"],
        )


@dataclass(frozen=True)
class SourceShard:
    """One source shard of a split (eagleflow.regenerate.sources)."""

    dataset: Path  # data.path, the file that was split
    manifest: dict  # the split's manifest (results/regenerated/sources.json)
    shard_id: str


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


@dataclass
class SourceChunks:
    """A source shard read and cut into chunks of conversations, with those already committed."""

    source: SourceShard
    entry: dict  # the shard's manifest entry: row range, first and last row
    chunks: list[list[Conversation]]
    bad: list[BadRow]  # rows that could not be read (kept as rejects under on_bad_row: skip)
    rows_read: int
    partial_dir: Path  # .partial/<id>/: the committed chunks
    done: dict[int, dict]  # chunk index -> its committed record
    started: float = field(default_factory=time.time)  # when the job began reading

    @property
    def todo(self) -> list[int]:
        return [i for i in range(len(self.chunks)) if i not in self.done]


@dataclass
class Answered:
    """What a job answered now: nothing (no generator) when every chunk was committed."""

    chunks: int = 0
    replies: int = 0
    rounds: int = 0
    stopped_early: int = 0
    truncated: int = 0  # replies cut at max_new_tokens
    truncated_dropped: int = 0  # of those, dropped (on_truncated: drop)
    tool_calls_diverged: int = 0  # tool rows ended where the target's calls were not the row's
    # With a reasoning parser: replies checked to render back to their generated ids
    # (replies.rerender_check): exactly, as a cut reply's prefix, or not (named in the log).
    rerendered: dict | None = None
    generator: Generator | None = None
    engine_start_s: float = 0.0  # until the engine was ready: a load, or a connection

    @property
    def engine(self) -> dict:
        """The job's engine record: served or its own, and whether this job paid a load."""
        if self.generator is None:
            return {"server": False, "loaded_here": False, "server_pid": None}
        return dict(self.generator.engine)


def load_chunks(
    source: SourceShard, settings: Regeneration, partial_dir: Path, log=print
) -> SourceChunks:
    """Read the shard's rows (checking they are still the ones it was split from), cut its
    conversations into chunks of `settings.chunk_rows`, and keep the chunks a killed job
    committed (the same conversations, in `partial_dir`)."""
    started = time.time()
    manifest, shard_id = source.manifest, source.shard_id
    entry = shard_entry(manifest, shard_id)
    if source_shard_id(manifest["identity"], shard_raw_rows(source.dataset, entry)) != shard_id:
        raise DatasetError(
            f"{source.dataset} changed after it was split into source shards (rows "
            f"{entry['first_row']}-{entry['last_row']} are not those of shard {shard_id}); "
            "run snakemake again to split it anew"
        )
    conversations, bad = read_conversations(
        source.dataset, require_assistant=False, rows=tuple(entry["rows"])
    )
    if bad and settings.on_bad_row == "error":
        raise DatasetError(f"{bad[0].message()} ({len(bad)} bad rows in this source shard)")
    n = settings.chunk_rows
    chunks = [conversations[i : i + n] for i in range(0, len(conversations), n)]
    partial_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for i, chunk in enumerate(chunks):
        found = read_chunk(chunk_file(partial_dir, i), shard_id, i, [c.sample_id for c in chunk])
        if found is not None:
            done[i] = found
    loaded = SourceChunks(
        source, entry, chunks, bad, len(conversations) + len(bad), partial_dir, done, started
    )
    log(
        f"source shard {shard_id}: rows {entry['first_row']}-{entry['last_row']} of "
        f"{source.dataset}, {loaded.rows_read} rows, {len(conversations)} conversations in "
        f"{len(chunks)} chunks of up to {n}; {len(done)} chunks already committed"
    )
    return loaded


def answer_chunks(
    loaded: SourceChunks, settings: Regeneration, generator: Callable[[], Generator], log=print
) -> Answered:
    """Answer the chunks not yet committed, in order, each its own set of rounds, and commit
    each once answered (temporary name, then rename). `generator()` makes the generator (loads
    the engine, or connects to the shared one) after the tokenizer has loaded."""
    from tqdm import tqdm

    from eagleflow.target.load import load_tokenizer

    tokenizer = load_tokenizer(settings.target)
    render = chat_renderer(tokenizer, settings.chat_template_kwargs)
    parsed = settings.reasoning_parser is not None
    checked = settings.keeps_special_tokens
    form = ReplyForm(
        reasoning_splitter(settings.reasoning_parser, tokenizer) if parsed else None,
        settings.on_truncated,
        conversation_renderer(tokenizer, settings.chat_template_kwargs) if checked else None,
        tool_splitter(settings.tool_parser, tokenizer) if settings.tool_parser else None,
    )
    t_engine = time.time()
    generate = generator()
    answered = Answered(generator=generate, engine_start_s=time.time() - t_engine)
    shard_id, chunks = loaded.source.shard_id, loaded.chunks
    bar = tqdm(
        total=sum(len(c) for c in chunks),
        initial=sum(len(chunks[i]) for i in loaded.done),
        unit="conv",
        desc=f"regenerate {shard_id}",
        mininterval=5,
    )

    def round_log(message):
        log(message)
        if generate.generate_s > 0:
            bar.set_postfix_str(
                f"{generate.generated_tokens / generate.generate_s:.0f} generated tok/s"
            )

    for i in loaded.todo:
        rows, more_bad, chunk_stats = regenerate_conversations(
            chunks[i], generate, render, settings.max_length, round_log, form
        )
        if more_bad and settings.on_bad_row == "error":
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
                    **({"tools": r["tools"]} if "tools" in r else {}),
                }
                for r in rows
            ],
            "rejects": [reject_record(b) for b in more_bad],
        }
        write_atomically(chunk_file(loaded.partial_dir, i), json.dumps(record, ensure_ascii=False))
        loaded.done[i] = record
        answered.chunks += 1
        answered.replies += chunk_stats["replies"]
        answered.truncated += chunk_stats["truncated"]
        answered.truncated_dropped += chunk_stats["truncated_dropped"]
        answered.tool_calls_diverged += chunk_stats["tool_calls_diverged"]
        answered.rounds += chunk_stats["rounds"]
        answered.stopped_early += chunk_stats["stopped_early"]
        if "rerendered" in chunk_stats:
            total = answered.rerendered or dict.fromkeys(chunk_stats["rerendered"], 0)
            answered.rerendered = {k: total[k] + v for k, v in chunk_stats["rerendered"].items()}
        bar.update(len(chunks[i]))
    bar.close()
    return answered


def assemble(
    loaded: SourceChunks, answered: Answered, files: ShardFiles, settings: Regeneration, log=print
) -> dict:
    """Write the shard's rows (the chunks' rows in order), its rejects (sorted by row) and,
    last, its summary, each renamed into place; then drop the committed chunks."""
    source, chunks, done, entry = loaded.source, loaded.chunks, loaded.done, loaded.entry
    shard_id, rows_read = source.shard_id, loaded.rows_read
    rows = [r for i in range(len(chunks)) for r in done[i]["rows"]]
    rejects = sorted(
        [reject_record(b) for b in loaded.bad]
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
    generate = answered.generator
    engine = answered.engine
    summary = {
        "shard": shard_id,
        "source": str(source.dataset),
        "first_row": entry["first_row"],
        "last_row": entry["last_row"],
        "rows_read": rows_read,
        "rows_kept": len(rows),
        "rows_rejected": len(rejects),
        "chunks": len(chunks),
        "chunks_resumed": len(chunks) - answered.chunks,
        "chunks_regenerated": answered.chunks,
        "model_loaded": engine["loaded_here"],
        "engine": engine,
        "replies": sum(len([m for m in r["messages"] if m["role"] == "assistant"]) for r in rows),
        "replies_now": answered.replies,
        "rounds_now": answered.rounds,
        "stopped_early_now": answered.stopped_early,
        "truncated_now": answered.truncated,
        "truncated_dropped_now": answered.truncated_dropped,
        "tool_calls_diverged_now": answered.tool_calls_diverged,
        "finish_reasons_now": generate.finished if generate else None,
        "rerendered_now": answered.rerendered,
        "max_new_tokens": settings.max_new_tokens,
        "max_length": settings.max_length,
        "chunk_rows": settings.chunk_rows,
        "seconds": round(time.time() - loaded.started, 1),
        "engine_start_s": round(answered.engine_start_s, 1),
    }
    if generate and generate.generate_s > 0:
        summary.update(
            generated_tokens_now=generate.generated_tokens,
            generate_s=round(generate.generate_s, 1),
            tokens_per_second=round(generate.generated_tokens / generate.generate_s, 1),
        )
    write_atomically(files.summary, json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(loaded.partial_dir, ignore_errors=True)
    log(
        f"source shard {shard_id} done: {rows_read} rows read, {len(rows)} kept, "
        f"{len(rejects)} rejected; {summary['replies']} replies, {answered.replies} "
        f"generated now ({answered.chunks} of {len(chunks)} chunks; "
        f"{len(chunks) - answered.chunks} resumed)"
        + (
            f", {summary['tokens_per_second']} generated tok/s"
            if "tokens_per_second" in summary
            else ""
        )
        + f"; {summary['seconds']} s"
    )
    return summary


def regenerate_source_shard(
    source: SourceShard,
    files: ShardFiles,
    settings: Regeneration,
    generator: Callable[[], Generator],
    log=print,
) -> dict:
    """Regenerate one source shard; returns its summary.

    Its conversations are answered in chunks of `settings.chunk_rows` conversations, in order;
    each chunk is its own set of rounds (its own `generate` calls) and is committed, once
    answered, to `.partial/<id>/chunk-NNNNN.json`. A rerun after a kill keeps the committed
    chunks as they are and answers only the others, in the same batches an uninterrupted run
    uses: with greedy decoding the shard comes out the same.

    `generator()` makes the job's `Generator` and is called only when there are chunks to
    answer, so a job whose chunks are all committed loads no model and connects to no engine:
    `generator_for` (an engine of the job's own, or the shared engine server's client), or a
    test's fake replies."""
    loaded = load_chunks(source, settings, files.partial_dir, log)
    answered = answer_chunks(loaded, settings, generator, log) if loaded.todo else Answered()
    return assemble(loaded, answered, files, settings, log)
