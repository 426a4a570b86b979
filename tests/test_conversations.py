import json

import pandas as pd
import pytest
from conftest import write_jsonl

from eagleflow.data.conversations import DatasetError, normalize_messages, read_conversations

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
