"""The real-chat corpus of the embedded default: chitchat-dataset's grouped utterances as
alternating user/assistant turns (eagleflow.embedded.chitchat)."""

from pathlib import Path

from eagleflow.embedded import chitchat

A, B = "sender-a", "sender-b"


def utt(sender, text):
    return {"sender": sender, "text": text, "timestamp": "2018-05-02T19:38:15Z"}


def test_groups_become_alternating_turns():
    """Consecutive groups of one sender merge, empty utterances drop, first speaker = user."""
    conv = {
        "messages": [
            [utt(B, "hello?"), utt(B, "  ")],
            [utt(B, "anyone there")],
            [utt(A, "hi"), utt(A, "yes I am here")],
            [utt(A, "")],
            [utt(B, "great")],
        ]
    }
    assert chitchat.to_turns(conv) == [
        {"role": "user", "content": "hello?\nanyone there"},
        {"role": "assistant", "content": "hi\nyes I am here"},
        {"role": "user", "content": "great"},
    ]


def test_conversations_without_a_reply_or_with_three_speakers_are_dropped():
    assert chitchat.to_turns({"messages": [[utt(A, "hello")], [utt(A, "anyone?")]]}) is None
    assert chitchat.to_turns({"messages": [[utt(A, "x")], [utt(B, " ")]]}) is None
    three = {"messages": [[utt(A, "a")], [utt(B, "b")], [utt("c", "c")]]}
    assert chitchat.to_turns(three) is None
    assert chitchat.to_turns({"messages": []}) is None


def test_window_skips_greetings_and_ends_on_a_reply():
    msgs = [
        {"role": "user", "content": "hello?"},
        {"role": "assistant", "content": "hi!"},
        {"role": "user", "content": "what is the best book you read this year so far"},
        {"role": "assistant", "content": "probably dune"},
        {"role": "user", "content": "nice one, I liked that one a lot too honestly"},
        {"role": "assistant", "content": "yes"},
    ]
    assert chitchat.window(msgs, 4) == msgs[2:6]
    assert chitchat.window(msgs, 3) == msgs[2:4]  # a trailing user turn is cut
    assert chitchat.window(msgs[:2], 4) is None  # no user turn long enough
    assert chitchat.window(msgs[:3], 4) is None  # the long user turn has no reply


def test_conversations_are_a_seeded_sample_in_dataset_order():
    long = "tell me one thing that you really enjoy doing on weekends"
    raw = {
        f"c{i}": {"messages": [[utt(A, f"{long} {i}")], [utt(B, f"reply {i}")]]} for i in range(10)
    }
    raw["mono"] = {"messages": [[utt(A, long)]]}
    rows = chitchat.conversations(4, seed=1, raw=raw)
    assert len(rows) == 4 and rows == chitchat.conversations(4, seed=1, raw=raw)
    ids = [r["id"] for r in rows]
    assert ids == sorted(ids, key=lambda x: int(x.removeprefix("chitchat-c")))
    assert all(r["corpus"] == "chitchat" and len(r["messages"]) == 2 for r in rows)
    assert len(chitchat.conversations(100, raw=raw)) == 10  # all that qualify


def test_installed_package_is_read_not_the_network():
    """The pinned package's file: 7,168 conversations; 3,442 of them usable at a
    4-turn window (a reply to a user turn of 8+ words, no turn over 600 characters)."""
    raw = chitchat.load_raw()
    assert len(raw) == 7168
    rows = chitchat.conversations(10**6, raw=raw)
    assert len(rows) == 3442
    for r in rows[:200]:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) <= 4
        assert all(m["content"].strip() for m in r["messages"])


def test_bundled_rows_mix_chat_with_the_chosen_synthetic_families():
    from eagleflow.embedded.bundled_data import bundled_rows

    data = {
        "bundled_corpus": "mixed",
        "bundled_conversations": 40,
        "bundled_seed": 0,
        "bundled_max_messages": 4,
        "bundled_synthetic_share": 0.25,
        "bundled_synthetic_families": ["digits", "spelling"],
    }
    rows = bundled_rows(data)
    assert rows == bundled_rows(data) and len({r["id"] for r in rows}) == 40
    kinds = [r.get("family", r.get("corpus")) for r in rows]
    assert kinds.count("chitchat") == 30 and set(kinds) - {"chitchat"} <= {"digits", "spelling"}
    assert kinds[:30] != ["chitchat"] * 30  # interleaved
    only_chat = bundled_rows({**data, "bundled_corpus": "chitchat"})
    assert {r["corpus"] for r in only_chat} == {"chitchat"} and len(only_chat) == 40
    synthetic = bundled_rows({**data, "bundled_corpus": "synthetic"})
    assert {r["family"] for r in synthetic} <= {"digits", "spelling"}


def test_the_default_bundled_dataset_is_the_synthetic_corpus_of_all_six_families(tmp_path):
    """The schema's defaults give exactly `generate_conversations(n, seed)`: the embedded
    default's dataset (and so its target, shards and draft) is unchanged by the corpus keys."""
    from snakemake.utils import validate

    from eagleflow.embedded.bundled_data import bundled_rows, generate_conversations

    config = {"data": {}}
    validate(config, str(Path(__file__).parents[1] / "workflow/schemas/config.schema.yaml"))
    data = {k: v for k, v in config["data"].items() if k.startswith("bundled_")}
    assert data["bundled_corpus"] == "synthetic" and data["bundled_synthetic_families"] is None
    data["bundled_conversations"] = 50
    assert bundled_rows(data) == generate_conversations(50, data["bundled_seed"])
