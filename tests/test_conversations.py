import json

import pandas as pd
import pytest

from eagleflow.data.conversations import DatasetError, normalize_messages, read_conversations
from support.datasets import write_jsonl

OPENAI = {
    "id": "a",
    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
}
SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def test_openai_and_sharegpt_normalize_to_the_same_messages():
    assert normalize_messages(OPENAI) == normalize_messages(SHAREGPT)
    assert normalize_messages(SHAREGPT)[1] == {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"messages": []}, "empty conversation"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        (
            {
                "messages": [
                    {"role": "robot", "content": "hi"},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "unknown role 'robot'",
        ),
        ({"conversations": [{"from": "alien", "value": "hi"}]}, "unknown role 'alien'"),
        ({"text": "hi"}, "no `messages`"),
    ],
)
def test_bad_rows_are_named_with_their_reason(row, reason):
    with pytest.raises(ValueError, match=reason):
        normalize_messages(row)


def test_jsonl_bad_rows_keep_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [OPENAI, "{not json", {"messages": []}, SHAREGPT, {**OPENAI}]
    )
    good, bad = read_conversations(path)
    assert [c.source_row for c in good] == [1, 4]
    assert [(b.source_row, b.reason.split(" (")[0]) for b in bad] == [
        (2, "malformed JSON"),
        (3, "empty conversation"),
        (5, "duplicate sample id 'a'"),
    ]
    assert str(path) in bad[0].message() and "row 2" in bad[0].message()


def test_json_and_parquet_read_like_jsonl(tmp_path):
    rows = [OPENAI, SHAREGPT]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pd.DataFrame([{"id": "a", "messages": OPENAI["messages"]}]).to_parquet(tmp_path / "d.parquet")
    good_json, _ = read_conversations(tmp_path / "d.json")
    good_pq, _ = read_conversations(tmp_path / "d.parquet")
    assert good_json[0].messages == good_pq[0].messages == normalize_messages(OPENAI)


def test_missing_and_unknown_files_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        read_conversations(tmp_path / "d.csv")


def test_a_row_that_is_not_utf8_is_a_bad_row_and_its_neighbours_are_kept(tmp_path):
    path = tmp_path / "d.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps(OPENAI).encode() + b"\n")
        f.write(b'{"id": "b", "messages": [{"role": "user", "content": "caf\xe9"}]}\n')  # Latin-1
        f.write(json.dumps({**SHAREGPT, "id": "c"}).encode() + b"\n")
    good, bad = read_conversations(path)
    assert [c.sample_id for c in good] == ["a", "c"]
    (b,) = bad
    assert b.source_row == 2 and b.reason == "not UTF-8 (byte 0xe9 at byte 58)"
    assert f"{path}, row 2: not UTF-8" in b.message()


def test_openai_content_parts_are_joined_and_other_parts_named():
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you."}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
        ]
    }
    assert normalize_messages(parts) == (
        {"role": "user", "content": "Hello, you."},
        {"role": "assistant", "content": "Hi."},
    )
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    parts["messages"][0]["content"].append(image)
    with pytest.raises(ValueError, match="turn 0 content part 2 is of type 'image_url'"):
        normalize_messages(parts)


def test_prompt_only_data_without_regeneration_says_to_turn_it_on(tmp_path, tokenizer_dir):
    from eagleflow.data.shards import TokenShardOutputs, shard_dataset

    data = write_jsonl(tmp_path / "q.jsonl", [{"turns": ["Hi?"]}, {"turns": ["Why?", "How?"]}])
    for on_bad_row in ("error", "skip"):
        with pytest.raises(DatasetError) as e:
            shard_dataset(
                data,
                tokenizer_dir,
                TokenShardOutputs(tmp_path / "t", tmp_path / "m.parquet", tmp_path / "r.jsonl"),
                shard_size=4,
                max_length=64,
                on_bad_row=on_bad_row,
            )
        assert "the data holds prompts only" in str(e.value)
        assert "`data.regenerate.enabled: true`" in str(e.value)


def test_a_user_error_is_one_sentence_in_the_log_and_a_bug_keeps_its_traceback(tmp_path):
    from eagleflow.logs import redirect_to_log

    log = tmp_path / "job.log"
    with pytest.raises(SystemExit) as e:
        with redirect_to_log(log):
            raise DatasetError("d.jsonl, row 3: malformed JSON. Fix the row.")
    assert e.value.code == 1
    assert log.read_text() == "error: d.jsonl, row 3: malformed JSON. Fix the row.\n"
    with pytest.raises(SystemExit):
        with redirect_to_log(log):
            raise SystemExit("stop: a message")
    assert "Traceback" not in log.read_text() and "error: stop: a message" in log.read_text()
    with pytest.raises(KeyError):
        with redirect_to_log(log):
            raise KeyError("a bug")
    assert "Traceback (most recent call last)" in log.read_text()
