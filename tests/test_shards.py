import numpy as np
import pandas as pd
import pytest

from eagleflow.data.conversations import Conversation
from eagleflow.data.shards import (
    TokenShardOutputs,
    build_shards,
    read_token_shard,
    shard_dataset,
    write_token_shard,
)
from eagleflow.data.templating import tokenize_conversation, tokenizer_digest
from eagleflow.embedded.bundled_data import generate_conversations
from support.datasets import write_jsonl


def convs(n, seed=0):
    return [
        Conversation(r["id"], tuple(r["messages"]), "f", i)
        for i, r in enumerate(generate_conversations(n, seed))
    ]


def shards_of(tokenizer, conversations, size=4):
    toks = [tokenize_conversation(tokenizer, c.messages, 512) for c in conversations]
    return build_shards(conversations, toks, size, tokenizer_digest(tokenizer))


def test_shard_layout_and_roundtrip(tokenizer, tmp_path):
    shards = shards_of(tokenizer, convs(10))
    assert [len(s.sample_ids) for s in shards] == [4, 4, 2]
    s = shards[0]
    assert s.offsets[0] == 0 and s.offsets[-1] == len(s.input_ids) == len(s.loss_mask)
    write_token_shard(s, tmp_path / "s.safetensors")
    back = read_token_shard(tmp_path / "s.safetensors")
    assert back.shard_id == s.shard_id and back.sample_ids == s.sample_ids
    assert np.array_equal(back.input_ids, s.input_ids) and np.array_equal(back.offsets, s.offsets)


def test_shard_ids_follow_content_only(tokenizer):
    base = shards_of(tokenizer, convs(12))
    again = shards_of(tokenizer, convs(12))
    assert [s.shard_id for s in base] == [s.shard_id for s in again]
    # Appending samples leaves every full shard's id unchanged.
    appended = shards_of(tokenizer, convs(12) + convs(3, seed=9))
    assert [s.shard_id for s in appended[:3]] == [s.shard_id for s in base]
    assert len(appended) == 4
    # Editing one sample changes only its shard's id.
    edited = convs(12)
    c = edited[5]
    msgs = (
        c.messages[0],
        {"role": "assistant", "content": c.messages[1]["content"] + " Indeed."},
    ) + c.messages[2:]
    edited[5] = Conversation(c.sample_id, msgs, c.source_file, c.source_row)
    changed = [a.shard_id != b.shard_id for a, b in zip(base, shards_of(tokenizer, edited))]
    assert changed == [False, True, False]


def test_shard_id_covers_the_tokenizer(tokenizer):
    conversations = convs(4)
    toks = [tokenize_conversation(tokenizer, c.messages, 512) for c in conversations]
    a = build_shards(conversations, toks, 4, "tokenizer-a")[0].shard_id
    b = build_shards(conversations, toks, 4, "tokenizer-b")[0].shard_id
    assert a != b


def test_shard_dataset_manifest_and_bad_rows(tokenizer_dir, tmp_path):
    rows = [{"id": f"r{i}", "messages": list(c.messages)} for i, c in enumerate(convs(9))]
    rows.insert(3, {"messages": [{"role": "user", "content": "only a question"}]})
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    kw = dict(shard_size=4, max_length=512)
    with pytest.raises(ValueError, match=r"d.jsonl, row 4: no assistant turn"):
        shard_dataset(
            data,
            tokenizer_dir,
            TokenShardOutputs(tmp_path / "t", tmp_path / "m.parquet", tmp_path / "rej.jsonl"),
            on_bad_row="error",
            **kw,
        )
    summary = shard_dataset(
        data,
        tokenizer_dir,
        TokenShardOutputs(tmp_path / "t", tmp_path / "m.parquet", tmp_path / "rej.jsonl"),
        on_bad_row="skip",
        **kw,
    )
    assert summary["conversations"] == 9 and summary["rejected"] == 1 and summary["shards"] == 3
    rejects = pd.read_json(tmp_path / "rej.jsonl", lines=True)
    assert rejects[["source_row", "reason"]].values.tolist() == [[4, "no assistant turn"]]
    manifest = pd.read_parquet(tmp_path / "m.parquet")
    assert list(manifest.columns) == [
        "sample_id",
        "shard_id",
        "n_tokens",
        "n_loss_tokens",
        "source_file",
        "source_row",
    ]
    assert manifest["source_row"].tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    for shard_id, group in manifest.groupby("shard_id", sort=False):
        shard = read_token_shard(tmp_path / "t" / f"{shard_id}.safetensors")
        assert shard.sample_ids == group["sample_id"].tolist()
        assert np.diff(shard.offsets).tolist() == group["n_tokens"].tolist()


def test_truncation_that_drops_every_assistant_token_is_a_bad_row(tokenizer_dir, tmp_path):
    rows = [
        {
            "id": "long",
            "messages": [
                {"role": "user", "content": "word " * 200},
                {"role": "assistant", "content": "ok"},
            ],
        }
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match="no assistant tokens within the first 16 tokens"):
        shard_dataset(
            data,
            tokenizer_dir,
            TokenShardOutputs(tmp_path / "t", tmp_path / "m.parquet", tmp_path / "r.jsonl"),
            shard_size=4,
            max_length=16,
            on_bad_row="error",
        )
