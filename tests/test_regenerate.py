"""Response regeneration (eagleflow.regenerate): prompt-only and complete datasets, turn order,
kept sample ids, bad rows; and once through real vLLM on the embedded target."""

import json

import pandas as pd
import pytest

from eagleflow.data.conversations import DatasetError, read_conversations
from eagleflow.data.heldout import heldout_prompts
from eagleflow.data.shards import TokenShardOutputs, shard_dataset
from eagleflow.regenerate.replies import Generator, vllm_generator
from eagleflow.regenerate.shard import Regeneration, SourceShard, regenerate_source_shard
from eagleflow.regenerate.sources import regeneration_identity, split_sources
from support.datasets import rows_of, write_jsonl
from support.regeneration import IDENTITY, shard_files


def fake_generate(calls):
    """Replies as a `Generator` gets them: (text, finish reason, generated tokens)."""

    def generate(prompts):
        calls.append([len(p) for p in prompts])
        return [(f"reply after {len(p)} tokens", "stop", 4) for p in prompts]

    return generate


def test_prompt_only_rows_are_read_and_held_out_like_complete_ones(tmp_path):
    data = write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now shorter."]},
            {"messages": [{"role": "user", "content": "Hi"}]},
        ],
    )
    good, bad = read_conversations(data)  # prompt-only rows need regeneration
    assert not good and len(bad) == 2
    assert bad[0].reason == "no assistant turn"
    convs, bad = read_conversations(data, require_assistant=False)
    assert not bad and convs[0].sample_id == "81"
    assert [m["role"] for m in convs[0].messages] == ["user", "user"]
    prompts = heldout_prompts(convs, modulus=1)  # everything held out
    assert prompts[0]["messages"] == [{"role": "user", "content": "Write a haiku."}]
    assert prompts[0]["reference"] is None


def regenerate_all(
    data,
    tokenizer_dir,
    out,
    shard_rows=2,
    chunk_rows=1,
    generate=None,
    max_length=512,
    on_bad_row="error",
):
    """Split `data` into source shards and regenerate each (as the workflow's jobs do), with
    the replies of `generate` (prompt id lists -> (text, finish reason, generated tokens))."""
    manifest = split_sources(data, IDENTITY, shard_rows)
    out.mkdir(parents=True, exist_ok=True)
    settings = Regeneration(tokenizer_dir, max_length, 8, chunk_rows, on_bad_row)
    summaries = [
        regenerate_source_shard(
            SourceShard(data, manifest, s["id"]),
            shard_files(out, s["id"]),
            settings,
            lambda: Generator(generate or fake_generate([])),
        )
        for s in manifest["shards"]
    ]
    return manifest, summaries


def regenerated_rows(out, manifest):
    return [
        json.loads(line)
        for s in manifest["shards"]
        for line in (out / f"{s['id']}.jsonl").read_text().splitlines()
    ]


def test_regeneration_answers_every_user_turn_in_rounds_and_keeps_ids(tmp_path, tokenizer_dir):
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {
                "id": "a",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 2 plus 2?"},
                    {"role": "assistant", "content": "The dataset's answer."},
                    {"role": "user", "content": "And times 3?"},
                    {"role": "assistant", "content": "Another dataset answer."},
                ],
            },
            {"turns": ["Count to 3.", "Again.", "Once more."]},
            {
                "messages": [
                    {"role": "user", "content": "Spell cat."},
                    {"role": "assistant", "content": "c a t"},
                ]
            },
        ],
    )
    calls = []
    out = tmp_path / "out"
    manifest, (summary,) = regenerate_all(
        data, tokenizer_dir, out, shard_rows=3, chunk_rows=3, generate=fake_generate(calls)
    )
    rows = regenerated_rows(out, manifest)
    # round 1 answers three first turns, round 2 two second turns, round 3 the last one
    assert [len(c) for c in calls] == [3, 2, 1]
    assert summary["rounds_now"] == 3 and summary["replies"] == 6
    assert summary["rows_read"] == 3 and summary["rows_kept"] == 3 and summary["rows_rejected"] == 0
    a, b, c = rows
    assert a["id"] == "a" and [m["role"] for m in a["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert a["source"] == {"file": str(data), "row": 1} and c["source"]["row"] == 3
    assert "dataset" not in json.dumps(a) and a["messages"][2]["content"].startswith("reply after")
    # the second prompt holds the target's own first reply: it is longer than the first prompt
    assert int(a["messages"][4]["content"].split()[2]) > int(a["messages"][2]["content"].split()[2])
    assert [m["role"] for m in b["messages"]] == ["user", "assistant"] * 3
    # ids: the dataset's, else the content hash of the row as read (the held-out split is stable)
    original, _ = read_conversations(data, require_assistant=False)
    assert [r["id"] for r in rows] == [conv.sample_id for conv in original]
    # the output is a complete dataset the shard rule reads, naming the dataset's rows
    sid = manifest["shards"][0]["id"]
    convs, bad = read_conversations(out / f"{sid}.jsonl")
    assert len(convs) == 3 and not bad and [c.source_row for c in convs] == [1, 2, 3]
    assert (out / f"{sid}.rejects.jsonl").read_bytes() == b""  # nothing, not a blank line
    assert not (out / ".partial" / sid).exists()


def test_regeneration_bad_rows_and_long_prompts_are_named(tmp_path, tokenizer_dir):
    long_prompt = " ".join(["word"] * 400)
    data = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"turns": ["Count to 3."]},
            {"turns": [long_prompt]},
            "{not json",
        ],
    )
    with pytest.raises(DatasetError, match=r"d.jsonl, row 3: malformed JSON"):
        regenerate_all(data, tokenizer_dir, tmp_path / "o", shard_rows=3, max_length=64)
    manifest, (summary,) = regenerate_all(
        data, tokenizer_dir, tmp_path / "o", shard_rows=3, max_length=64, on_bad_row="skip"
    )
    sid = manifest["shards"][0]["id"]
    rejected = [
        json.loads(line)
        for line in (tmp_path / "o" / f"{sid}.rejects.jsonl").read_text().splitlines()
    ]
    assert [r["source_row"] for r in rejected] == [2, 3] and summary["rows_kept"] == 1
    assert "first prompt is at least 64 tokens" in rejected[0]["reason"]
    assert summary["rows_kept"] + summary["rows_rejected"] == summary["rows_read"] == 3


def test_source_shard_ids_follow_rows_target_and_settings(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(10))
    ids = [s["id"] for s in split_sources(data, IDENTITY, 4)["shards"]]
    assert len(ids) == 3 == len(set(ids))
    # appending rows: the full shards keep their ids, the last one changes, new ones follow
    write_jsonl(tmp_path / "d.jsonl", rows_of(14))
    appended = [s["id"] for s in split_sources(data, IDENTITY, 4)["shards"]]
    assert appended[:2] == ids[:2] and appended[2] != ids[2] and len(appended) == 4
    # editing one row: only its shard's id changes
    edited = rows_of(10)
    edited[5]["turns"] = ["An edited question?"]
    write_jsonl(tmp_path / "d.jsonl", edited)
    after = [s["id"] for s in split_sources(data, IDENTITY, 4)["shards"]]
    assert [a == b for a, b in zip(ids, after)] == [True, False, True]
    # another target or other generation settings: every id changes
    for other in (
        regeneration_identity({"config.json": "another target"}, 8, 512, True),
        regeneration_identity(IDENTITY["target"], 16, 512, True),
        regeneration_identity(IDENTITY["target"], 8, 512, False),
    ):
        assert not set(s["id"] for s in split_sources(data, other, 4)["shards"]) & set(after)
    # the manifest counts the user turns each job answers (its cluster time limit)
    assert [s["prompts"] for s in split_sources(data, IDENTITY, 4)["shards"]] == [4, 4, 2]


def test_a_killed_shard_resumes_after_its_committed_chunks(tmp_path, tokenizer_dir):
    data = write_jsonl(tmp_path / "d.jsonl", rows_of(7))
    reference, _ = regenerate_all(data, tokenizer_dir, tmp_path / "ref", shard_rows=7, chunk_rows=2)
    (sid,) = [s["id"] for s in reference["shards"]]

    calls = []

    def dies_on_third_call(prompts):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")  # as a SIGKILL: nothing after this point runs
        return fake_generate([])(prompts)

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        regenerate_all(
            data, tokenizer_dir, out, shard_rows=7, chunk_rows=2, generate=dies_on_third_call
        )
    partial = out / ".partial" / sid
    committed = sorted(p.name for p in partial.glob("chunk-*.json"))
    assert committed == ["chunk-00000.json", "chunk-00001.json"]
    assert not (out / f"{sid}.jsonl").exists()
    kept = [(partial / n).read_bytes() for n in committed]
    # A torn temporary file from the kill is ignored.
    (partial / "chunk-00002.json.tmp").write_text('{"shard": "')
    calls.clear()
    _, (summary,) = regenerate_all(
        data, tokenizer_dir, out, shard_rows=7, chunk_rows=2, generate=fake_generate(calls)
    )
    # only the chunks not committed were generated: rows 5-7 in two chunks (2 + 1)
    assert [len(c) for c in calls] == [2, 1]
    assert summary["chunks_resumed"] == 2 and summary["chunks_regenerated"] == 2
    assert summary["replies_now"] == 3 and summary["replies"] == 7
    # the same file as the uninterrupted run, byte for byte; committed rows kept as they were
    assert (out / f"{sid}.jsonl").read_bytes() == (tmp_path / "ref" / f"{sid}.jsonl").read_bytes()
    first_rows = [json.loads(line) for line in (out / f"{sid}.jsonl").read_text().splitlines()]
    assert first_rows[:4] == [r for k in kept for r in json.loads(k)["rows"]]


def test_a_shard_whose_chunks_are_all_committed_needs_no_generator(
    tmp_path, tokenizer_dir, monkeypatch
):
    import eagleflow.regenerate.shard as regen

    data = write_jsonl(tmp_path / "d.jsonl", rows_of(4))
    real_write = regen.write_atomically

    def dies_before_the_shard_file(path, text):
        if path.suffix == ".jsonl" and not path.name.startswith("chunk"):
            raise KeyboardInterrupt("killed after the last chunk")
        real_write(path, text)

    monkeypatch.setattr(regen, "write_atomically", dies_before_the_shard_file)
    with pytest.raises(KeyboardInterrupt):
        regenerate_all(data, tokenizer_dir, tmp_path / "o", shard_rows=4, chunk_rows=2)
    monkeypatch.setattr(regen, "write_atomically", real_write)

    def must_not_run(prompts):
        raise AssertionError("the model was needed")

    _, (summary,) = regenerate_all(
        data, tokenizer_dir, tmp_path / "o", shard_rows=4, chunk_rows=2, generate=must_not_run
    )
    assert summary["model_loaded"] is False and summary["chunks_resumed"] == 2


def test_rows_kept_plus_rejected_equal_rows_read_through_sharding(tmp_path, tokenizer_dir):
    """Every row of the dataset ends in the manifest or in the gathered rejects file."""
    lines = [json.dumps(r) for r in rows_of(6)]
    lines[1] = '{"turns": ["caf\xe9"]}'.encode("latin-1").decode("latin-1")  # placeholder
    data = tmp_path / "d.jsonl"
    with open(data, "wb") as f:
        for i, line in enumerate(lines):
            if i == 1:
                f.write(b'{"id": "latin", "turns": ["caf' + b"\xe9" + b'"]}\n')
            elif i == 3:
                f.write(b"{not json\n")
            else:
                f.write(line.encode() + b"\n")
        f.write(json.dumps({"id": "q0", "turns": ["a duplicate id"]}).encode() + b"\n")
        f.write(json.dumps({"turns": [" ".join(["word"] * 400)]}).encode() + b"\n")
    manifest, summaries = regenerate_all(
        data, tokenizer_dir, tmp_path / "o", shard_rows=3, max_length=64, on_bad_row="skip"
    )
    assert sum(s["rows_read"] for s in summaries) == manifest["rows_read"] == 8
    for s in summaries:
        assert s["rows_kept"] + s["rows_rejected"] == s["rows_read"]
    ids = [s["id"] for s in manifest["shards"]]
    summary = shard_dataset(
        [tmp_path / "o" / f"{i}.jsonl" for i in ids],
        tokenizer_dir,
        TokenShardOutputs(tmp_path / "t", tmp_path / "m.parquet", tmp_path / "rej.jsonl"),
        shard_size=2,
        max_length=64,
        on_bad_row="skip",
        earlier_rejects=[tmp_path / "o" / f"{i}.rejects.jsonl" for i in ids],
    )
    frame = pd.read_parquet(tmp_path / "m.parquet")
    rejects = [json.loads(line) for line in (tmp_path / "rej.jsonl").read_text().splitlines()]
    assert len(frame) + len(rejects) == 8
    assert summary["rejected_by_regeneration"] == 3 and summary["rejected"] == 1
    by_row = {r["source_row"]: (r["stage"], r["reason"]) for r in rejects}
    assert by_row[2][0] == "regenerate" and "not UTF-8" in by_row[2][1]
    assert "malformed JSON" in by_row[4][1] and "first prompt" in by_row[8][1]
    assert by_row[7] == ("shard", "duplicate sample id 'q0'")
    # the manifest names the dataset's rows, not the regenerated files' lines
    assert set(frame["source_file"]) == {str(data)}
    assert sorted(frame["source_row"]) == [1, 3, 5, 6]
    # a token shard never spans two source shards (shard_size 2, source shards of 3 rows)
    assert (
        frame.groupby("shard_id")["source_row"]
        .apply(lambda r: (max(r) - 1) // 3 == (min(r) - 1) // 3)
        .all()
    )


@pytest.mark.vllm
def test_regeneration_through_vllm_is_greedy_and_stops_at_end_of_turn(tmp_path):
    """A tiny (untrained) DeepseekV3 target answers two prompts through vLLM's LLM.generate,
    with the embedded default's engine settings (MLA off, as on CPU; max_num_seqs set)."""
    from eagleflow.embedded.bundled_data import generate_conversations
    from eagleflow.embedded.tiny_target import build_tiny_target

    rows = generate_conversations(300, seed=1)
    target = build_tiny_target(
        [m["content"] for r in rows for m in r["messages"]], tmp_path / "target"
    )
    data = write_jsonl(
        tmp_path / "q.jsonl",
        [{"turns": ["What is 2 plus 3?", "And 4 plus 4?"]}, {"turns": ["Spell the word dog."]}],
    )
    from eagleflow.engine.settings import EngineSettings

    manifest = split_sources(data, IDENTITY, 2)
    (sid,) = [s["id"] for s in manifest["shards"]]
    files = shard_files(tmp_path, sid)
    settings = EngineSettings(str(target), max_model_len=128 + 12, max_num_seqs=4, mla=False)
    summary = regenerate_source_shard(
        SourceShard(data, manifest, sid),
        files,
        Regeneration(target, max_length=128, max_new_tokens=12, chunk_rows=2),
        lambda: vllm_generator(settings, 12),
    )
    rows = [json.loads(line) for line in files.rows.read_text().splitlines()]
    assert summary["replies"] == 3 and sum(summary["finish_reasons_now"].values()) == 3
    assert summary["model_loaded"] and summary["engine_start_s"] > 0
    assert 3 <= summary["generated_tokens_now"] <= 36 and summary["tokens_per_second"] > 0
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert all(isinstance(m["content"], str) for r in rows for m in r["messages"])
