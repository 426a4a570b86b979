"""Response regeneration (eagleflow.data.regenerate): prompt-only and complete datasets, turn order,
kept sample ids, bad rows; and once through real vLLM on the embedded target."""

import json

import pytest
from conftest import write_jsonl

from eagleflow.data.conversations import DatasetError, read_conversations
from eagleflow.data.heldout import heldout_prompts
from eagleflow.data.regenerate import regenerate_dataset
from eagleflow.engine.settings import EngineSettings


def fake_generate(calls):
    def generate(prompts):
        calls.append([len(p) for p in prompts])
        return [f"reply after {len(p)} tokens" for p in prompts]

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
    out, rejects = tmp_path / "out.jsonl", tmp_path / "rejects.jsonl"
    summary = regenerate_dataset(
        data,
        tokenizer_dir,
        out,
        rejects,
        max_length=512,
        max_new_tokens=8,
        generate=fake_generate(calls),
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # round 1 answers three first turns, round 2 two second turns, round 3 the last one
    assert [len(c) for c in calls] == [3, 2, 1]
    assert summary["rounds"] == 3 and summary["replies"] == 6 and summary["rejected"] == 0
    a, b, c = rows
    assert a["id"] == "a" and [m["role"] for m in a["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert "dataset" not in json.dumps(a) and a["messages"][2]["content"].startswith("reply after")
    # the second prompt holds the target's own first reply: it is longer than the first prompt
    assert int(a["messages"][4]["content"].split()[2]) > int(a["messages"][2]["content"].split()[2])
    assert [m["role"] for m in b["messages"]] == ["user", "assistant"] * 3
    # ids: the dataset's, else the content hash of the row as read (the held-out split is stable)
    original, _ = read_conversations(data, require_assistant=False)
    assert [r["id"] for r in rows] == [conv.sample_id for conv in original]
    # the output is a complete dataset the shard rule reads
    convs, bad = read_conversations(out)
    assert len(convs) == 3 and not bad and rejects.read_text() == ""


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
        regenerate_dataset(
            data,
            tokenizer_dir,
            tmp_path / "o.jsonl",
            tmp_path / "r.jsonl",
            64,
            8,
            generate=fake_generate([]),
        )
    summary = regenerate_dataset(
        data,
        tokenizer_dir,
        tmp_path / "o.jsonl",
        tmp_path / "r.jsonl",
        64,
        8,
        on_bad_row="skip",
        generate=fake_generate([]),
    )
    rejected = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [r["source_row"] for r in rejected] == [2, 3] and summary["conversations"] == 1
    assert "first prompt is at least 64 tokens" in rejected[0]["reason"]


@pytest.mark.vllm
def test_regeneration_through_vllm_is_greedy_and_stops_at_end_of_turn(tmp_path):
    """A tiny (untrained) DeepseekV3 target answers two prompts through vLLM's LLM.generate,
    with the embedded default's engine settings (MLA off, as on CPU; max_num_seqs set)."""
    from eagleflow.fixtures.bundled_data import generate_conversations
    from eagleflow.fixtures.tiny_target import build_tiny_target

    rows = generate_conversations(300, seed=1)
    target = build_tiny_target(
        [m["content"] for r in rows for m in r["messages"]], tmp_path / "target"
    )
    data = write_jsonl(
        tmp_path / "q.jsonl",
        [{"turns": ["What is 2 plus 3?", "And 4 plus 4?"]}, {"turns": ["Spell the word dog."]}],
    )
    summary = regenerate_dataset(
        data,
        target,
        tmp_path / "o.jsonl",
        tmp_path / "r.jsonl",
        max_length=128,
        max_new_tokens=12,
        engine=EngineSettings(str(target), max_model_len=128 + 12, max_num_seqs=4, mla=False),
    )
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert summary["replies"] == 3 and sum(summary["finish_reasons"].values()) == 3
    assert 3 <= summary["generated_tokens"] <= 36 and summary["tokens_per_s"] > 0
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert all(isinstance(m["content"], str) for r in rows for m in r["messages"])
