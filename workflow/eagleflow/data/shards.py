"""Tokenized shards: content-addressed token files plus a Parquet manifest.

A shard is `shard_size` consecutive samples in dataset order, so appending samples leaves
every full shard as it was and editing a sample changes only its own shard. Its id is a hash
of what it holds (sample ids, tokens, masks) and of the tokenizer and chat template.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagleflow.data.conversations import Conversation, DatasetError
from eagleflow.data.templating import DEFAULT, TemplateSettings, Tokenized


@dataclass(frozen=True)
class TokenShard:
    shard_id: str
    sample_ids: list[str]
    input_ids: np.ndarray  # int64 [total_tokens]
    loss_mask: np.ndarray  # uint8 [total_tokens]
    offsets: np.ndarray  # int64 [n_samples + 1]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[a:b], self.loss_mask[a:b]


def shard_id_for(sample_ids, tokenized: list[Tokenized], tokenizer_digest: str) -> str:
    h = hashlib.sha256()
    h.update(tokenizer_digest.encode())
    for sid, t in zip(sample_ids, tokenized):
        h.update(sid.encode() + b"\0")
        h.update(np.int64(len(t.input_ids)).tobytes())
        h.update(t.input_ids.astype(np.int64).tobytes())
        h.update(t.loss_mask.astype(np.uint8).tobytes())
    return h.hexdigest()[:20]


def build_shards(
    conversations: list[Conversation],
    tokenized: list[Tokenized],
    shard_size: int,
    tokenizer_digest: str,
) -> list[TokenShard]:
    shards = []
    for start in range(0, len(conversations), shard_size):
        convs = conversations[start : start + shard_size]
        toks = tokenized[start : start + shard_size]
        sample_ids = [c.sample_id for c in convs]
        lengths = np.array([len(t.input_ids) for t in toks], dtype=np.int64)
        shards.append(
            TokenShard(
                shard_id=shard_id_for(sample_ids, toks, tokenizer_digest),
                sample_ids=sample_ids,
                input_ids=np.concatenate([t.input_ids for t in toks]).astype(np.int64),
                loss_mask=np.concatenate([t.loss_mask for t in toks]).astype(np.uint8),
                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            )
        )
    return shards


def write_token_shard(shard: TokenShard, path: str | Path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {
            "input_ids": torch.from_numpy(shard.input_ids),
            "loss_mask": torch.from_numpy(shard.loss_mask),
            "offsets": torch.from_numpy(shard.offsets),
        },
        str(tmp),
        metadata={"shard_id": shard.shard_id, "sample_ids": json.dumps(shard.sample_ids)},
    )
    tmp.replace(path)


def read_token_shard(path: str | Path) -> TokenShard:
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        return TokenShard(
            shard_id=meta["shard_id"],
            sample_ids=json.loads(meta["sample_ids"]),
            input_ids=f.get_tensor("input_ids"),
            loss_mask=f.get_tensor("loss_mask"),
            offsets=f.get_tensor("offsets"),
        )


def manifest_frame(conversations: list[Conversation], shards: list[TokenShard]) -> pd.DataFrame:
    rows = []
    i = 0
    for shard in shards:
        for j, sid in enumerate(shard.sample_ids):
            conv = conversations[i]
            rows.append(
                {
                    "sample_id": sid,
                    "shard_id": shard.shard_id,
                    "n_tokens": int(shard.offsets[j + 1] - shard.offsets[j]),
                    "n_loss_tokens": int(
                        shard.loss_mask[shard.offsets[j] : shard.offsets[j + 1]].sum()
                    ),
                    "source_file": conv.source_file,
                    "source_row": conv.source_row,
                }
            )
            i += 1
    return pd.DataFrame(rows)


PROMPTS_ONLY = "no assistant turn"


def prompts_only_error(bad: list, n_rows: int):
    """The sentence for a dataset of prompts (no assistant turn) read without regeneration."""
    first = bad[0]
    return DatasetError(
        f"{first.source_file}, row {first.source_row}: the data holds prompts only (no "
        f"assistant turn in {len(bad)} of {n_rows} rows); set `data.regenerate.enabled: true` "
        "in the config so the target writes the replies (docs/draft-training.md#regeneration)"
    )


def write_rejects(bad: list, path) -> None:
    """The rejects as JSON lines; an empty file when there are none."""
    with open(path, "w", encoding="utf-8") as f:
        for b in bad:
            f.write(json.dumps(b, ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class TokenShardOutputs:
    """The files the `shard` rule writes, each atomically."""

    tokens: Path  # directory of <shard_id>.safetensors token shards
    manifest: Path  # Parquet, one row per kept sample (manifest_frame)
    rejects: Path  # JSON lines, this stage's rejects then earlier stages'; empty if none
    summary: Path | None = None  # JSON: shard_dataset's summary (forms, fields_not_rendered)


def shard_dataset(
    dataset_paths,
    tokenizer_dir,
    out: TokenShardOutputs,
    *,
    shard_size: int,
    max_length: int,
    on_bad_row: str,
    template: TemplateSettings = DEFAULT,
    on_unrendered_field: str = "count",
    earlier_rejects=(),
    log=print,
) -> dict:
    """Read, template, mask, truncate and shard a dataset; write token shards, manifest, rejects.

    `dataset_paths`: one file, or several read in order (regenerated source shards); a token
    shard never spans two files, so each file's shards depend on that file alone.
    `template`: how the chat template is applied (kwargs, which samples of a reasoning
    template are kept). `on_unrendered_field`: `count` a field the template ignores in the
    summary (`fields_not_rendered`), or `error` at its first row.
    `earlier_rejects`: rejects files of an earlier stage (regeneration), gathered into
    `out.rejects` after this stage's own, with a `stage` field."""
    from eagleflow.data.templating import tokenizer_digest
    from eagleflow.target.load import load_tokenizer

    paths = [dataset_paths] if isinstance(dataset_paths, (str, Path)) else list(dataset_paths)
    tokenizer = load_tokenizer(tokenizer_dir)
    digest = tokenizer_digest(tokenizer, template)
    kept_all, shards, bad_all, rows_read = [], [], [], 0
    tally = FieldTally()
    seen: set = set()
    for path in paths:  # one file at a time, sample ids unique across all of them
        kept, tokenized, bad, n_rows = _tokenize_file(
            path, tokenizer, max_length, seen, template, tally
        )
        if on_unrendered_field == "error" and tally.first:
            raise DatasetError(tally.error())
        kept_all += kept
        bad_all += bad
        rows_read += n_rows
        shards += build_shards(kept, tokenized, shard_size, digest)
    _refuse_bad_rows(paths, kept_all, bad_all, rows_read, on_bad_row)
    out.tokens.mkdir(parents=True, exist_ok=True)
    for shard in shards:
        write_token_shard(shard, out.tokens / f"{shard.shard_id}.safetensors")
    frame = manifest_frame(kept_all, shards)
    tmp = out.manifest.with_name(out.manifest.name + ".tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(out.manifest)
    rejects = [{"stage": "shard", **asdict(b)} for b in bad_all]
    earlier = [
        {"stage": "regenerate", **json.loads(line)}
        for p in earlier_rejects
        for line in Path(p).read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    write_rejects(rejects + earlier, out.rejects)
    summary = {
        "conversations": tally.rows,
        "samples": len(kept_all),
        "rejected": len(bad_all),
        "rejected_by_regeneration": len(earlier),
        "shards": len(shards),
        "tokens": int(frame["n_tokens"].sum()),
        "loss_tokens": int(frame["n_loss_tokens"].sum()),
        **tally.summary(),
    }
    if out.summary is not None:
        tmp = out.summary.with_name(out.summary.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(out.summary)
    log(
        f"sharded {len(paths)} file(s) ({paths[0]}{', ...' if len(paths) > 1 else ''}): "
        f"{rows_read} rows read, {tally.rows} kept as {len(kept_all)} samples, "
        f"{len(bad_all)} rejected here"
        + (f", {len(earlier)} rejected by regeneration" if earlier_rejects else "")
        + f"; {summary}"
        + (f"; rejects written to {out.rejects}" if rejects or earlier else "")
    )
    if tally.not_rendered:
        log(
            "fields the chat template does not render (kept in no sample): "
            + ", ".join(f"{f} in {n} rows" for f, n in tally.not_rendered.items())
            + f" (first: {tally.first[1]}, row {tally.first[2]}); set "
            "`data.on_unrendered_field: error` to stop on them"
        )
    return summary


@dataclass
class FieldTally:
    """Rows, samples and reasoning tokens kept per form, and the fields the template ignored."""

    rows: int = 0
    truncated_away: int = 0  # samples of kept rows whose truncation left no loss token
    forms: dict = field(default_factory=dict)  # form -> {rows, samples, reasoning_tokens}
    not_rendered: dict = field(default_factory=dict)  # field -> rows
    first: tuple | None = None  # (field, file, row) of the first ignored field

    def add(self, conv: Conversation, rendered) -> None:
        self.rows += 1
        self.truncated_away += rendered.dropped_samples
        for form in conv.forms:
            f = self.forms.setdefault(form, {"rows": 0, "samples": 0, "reasoning_tokens": 0})
            f["rows"] += 1
            f["samples"] += len(rendered.samples)
            f["reasoning_tokens"] += rendered.reasoning_tokens
        for name in rendered.not_rendered:
            self.not_rendered[name] = self.not_rendered.get(name, 0) + 1
            if self.first is None:
                self.first = (name, conv.source_file, conv.source_row)

    def summary(self) -> dict:
        return {
            "samples_truncated_away": self.truncated_away,
            "forms": self.forms,
            "fields_not_rendered": self.not_rendered,
        }

    def error(self) -> str:
        name, file, row = self.first
        return (
            f"{file}, row {row}: the chat template does not render the row's `{name}` (it "
            "renders the same with and without it), so the draft would never see it; use a "
            "template that renders it (or other `data.chat_template_kwargs`), remove the field, "
            "or set `data.on_unrendered_field: count` to go on and count such rows"
        )


def _tokenize_file(path, tokenizer, max_length: int, seen: set, template, tally: FieldTally):
    """(kept samples, their tokenizations, bad rows in row order, rows read) of one file.

    A conversation becomes one sample, or several for a template that renders history
    differently (eagleflow.data.templating): each is a `Conversation` with its sample id.
    A row the template raises on, or whose truncation leaves no assistant token, is a bad row."""
    from dataclasses import replace

    from eagleflow.data.conversations import BadRow, read_conversations
    from eagleflow.data.templating import render_conversation

    conversations, bad = read_conversations(path, seen=seen)
    rows_read = len(conversations) + len(bad)
    kept, tokenized = [], []
    for conv in conversations:
        try:
            rendered = render_conversation(
                tokenizer, conv.messages, max_length, template, conv.tools
            )
        except Exception as e:  # the template's own errors (jinja, RecursionError) included
            reason = f"the chat template cannot render the row: {type(e).__name__}: {e}"
            bad.append(BadRow(conv.source_file, conv.source_row, reason, conv.sample_id))
            continue
        if not rendered.samples:
            reason = f"no assistant tokens within the first {max_length} tokens"
            bad.append(BadRow(conv.source_file, conv.source_row, reason, conv.sample_id))
            continue
        tally.add(conv, rendered)
        for suffix, t in rendered.samples:
            kept.append(replace(conv, sample_id=conv.sample_id + suffix))
            tokenized.append(t)
    bad.sort(key=lambda b: b.source_row)
    return kept, tokenized, bad, rows_read


def _refuse_bad_rows(paths, kept: list, bad: list, rows_read: int, on_bad_row: str) -> None:
    prompts_only = [b for b in bad if b.reason == PROMPTS_ONLY]
    if prompts_only and not kept:  # a prompt-only dataset, not a few bad rows
        raise prompts_only_error(prompts_only, rows_read)
    if bad and on_bad_row == "error":
        raise DatasetError(f"{bad[0].message()} ({len(bad)} bad rows in all)")
    if not kept:
        raise DatasetError(f"{', '.join(map(str, paths))}: no usable conversations")
