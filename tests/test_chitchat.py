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


def test_the_default_bundled_dataset_is_the_synthetic_corpus_of_the_default_families(tmp_path):
    """The schema's defaults give exactly `generate_conversations(n, seed, families)` of the
    six families whose replies the tiny target did not loop on (arithmetic, counting and
    sorting left out)."""
    from snakemake.utils import validate

    from eagleflow.embedded.bundled_data import bundled_rows, generate_conversations

    config = {"data": {}}
    validate(config, str(Path(__file__).parents[1] / "workflow/schemas/config.schema.yaml"))
    data = {k: v for k, v in config["data"].items() if k.startswith("bundled_")}
    families = data["bundled_synthetic_families"]
    assert data["bundled_corpus"] == "synthetic"
    rewriting = {"signs", "capitalize", "digit_words"}
    assert set(families) == {"capitals", "spelling", "digits"} | rewriting
    data["bundled_conversations"] = 200
    rows = bundled_rows(data)
    assert rows == generate_conversations(200, data["bundled_seed"], families)
    assert {r["family"] for r in rows} == set(families)


def test_a_rewriting_reply_varies_with_its_prompt_and_repeats_no_two_token_run():
    """signs, capitalize, digit_words: four items, copied (signs) or rewritten (a capital, a
    digit's word) and joined by three different signs, so that, token for token, no two
    consecutive reply tokens occur in the prompt or earlier in the reply, even where an item
    repeats: n-gram speculation (a lookup of at least 2 tokens) has nothing to copy."""
    from eagleflow.embedded.bundled_data import NUMBER_WORDS, generate_conversations
    from eagleflow.embedded.tiny_target import train_tokenizer

    rows = generate_conversations(300, 0, ["signs", "capitalize", "digit_words"])
    replies = [r["messages"][1]["content"] for r in rows]
    assert len(set(replies)) > 280  # 4 of 30 words, or 4 digits: nearly all distinct
    tok = train_tokenizer([m["content"] for r in rows for m in r["messages"]], 512)
    repeats = 0
    for r in rows:
        prompt, reply = (m["content"] for m in r["messages"])
        items = prompt.split(": ")[1].split(", ")
        words = reply[:-1].replace("+", "-").replace("/", "-").split("-")
        if r["family"] == "signs":  # the first item as in a sentence, the others verbatim
            assert all(w.startswith(" ") for w in words[1:]) and not words[0].startswith(" ")
            words = [w.strip() for w in words]
        assert len(items) == len(words) == 4
        if r["family"] == "digit_words":
            assert words == [NUMBER_WORDS[int(d)] for d in items]
        else:
            assert [w.lower() for w in words] == items
        p_ids = tok(prompt)["input_ids"]
        r_ids = tok(reply)["input_ids"]
        assert len(r_ids) == 2 * len(items)  # item, sign, ..., item, end: two tokens an item
        seen = {tuple(p_ids[i : i + 2]) for i in range(len(p_ids) - 1)}
        for i in range(len(r_ids) - 1):
            assert tuple(r_ids[i : i + 2]) not in seen, (prompt, reply)
            seen.add(tuple(r_ids[i : i + 2]))
        repeats += len(set(words)) < 4
    assert repeats > 10  # digit_words repeat digits: the signs keep their runs apart
