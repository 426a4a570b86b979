"""Reasoning and tool traffic through the target's own chat template (issue 37, data part):
message fields kept and passed, samples cut by rendering where history is rendered
differently, masks token by token on a Kimi-style and a Qwen3-style template, fields a
template ignores counted or refused, template errors as named rejects, the held-out split
keeping a conversation's samples together, and `data.chat_template_kwargs` in the ids."""

import hashlib
import json

import numpy as np
import pandas as pd
import pytest

from eagleflow.data.conversations import (
    DatasetError,
    content_id,
    normalize_messages,
    normalize_tools,
    read_conversations,
)
from eagleflow.data.heldout import conversation_of, is_heldout
from eagleflow.data.shards import TokenShardOutputs, read_token_shard, shard_dataset
from eagleflow.data.templating import (
    TemplateMismatch,
    TemplateSettings,
    render_conversation,
    tokenizer_digest,
)
from support.chat_templates import PLAIN, kimi_style, qwen3_style, with_template
from support.datasets import write_jsonl

CALL = {
    "id": "functions.weather:0",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
AGENT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Call the tool.",
        "tool_calls": [CALL],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "functions.weather:0", "name": "weather"},
    {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool says sunny."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Rain.", "reasoning_content": "Guess rain."},
]


def test_openai_fields_are_kept_and_reasoning_is_read_in_three_forms():
    given = normalize_messages({"messages": AGENT})
    assert given == tuple(AGENT)
    alias = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "r"},
    ]
    inline = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nr\n</think>\n\na"},
    ]
    expected = (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "r"},
    )
    assert (
        normalize_messages({"messages": alias})
        == normalize_messages({"messages": inline})
        == expected
    )
    # A row without the new fields keeps the id it had before they were read.
    plain = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
    old = hashlib.sha256(json.dumps(plain, sort_keys=True, ensure_ascii=False).encode())
    assert content_id(plain) == old.hexdigest()[:16] != content_id(plain, tuple(TOOLS))
    assert normalize_tools({"tools": json.dumps(TOOLS)}) == normalize_tools({"tools": TOOLS})
    # An empty reasoning is none (datasets carry `reasoning_content: ""` on every turn).
    empty = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": ""},
    ]
    assert normalize_messages({"messages": empty}) == plain


@pytest.mark.parametrize(
    "turn, reason",
    [
        (
            {"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "y"},
            "must be one string",
        ),
        ({"role": "user", "content": "a", "reasoning_content": "x"}, "reasoning on a user turn"),
        (
            {"role": "assistant", "content": "a", "tool_calls": [{"function": {}}]},
            "lacks `function.name`",
        ),
        ({"role": "user", "content": "a", "tool_calls": [CALL]}, "`tool_calls` on a user turn"),
        ({"role": "tool", "content": "a", "tool_call_id": 3}, "`tool_call_id` is not a string"),
        ({"role": "assistant", "content": "<think>a</think>b</think>c"}, "2 `</think>`"),
    ],
)
def test_malformed_fields_are_bad_rows_named_by_turn(turn, reason):
    with pytest.raises(ValueError, match=reason):
        normalize_messages({"messages": [{"role": "user", "content": "q"}, turn]})


def _expected(tok, segments):
    """(ids, mask) by construction: each (text, trained) segment encoded on its own (the
    segments split at special tokens, so the concatenation is the template's tokenization)."""
    ids, mask = [], []
    for text, trained in segments:
        part = tok.encode(text, add_special_tokens=False)
        ids += part
        mask += [int(trained)] * len(part)
    return np.array(ids), np.array(mask, dtype=np.uint8)


def _check(tok, got, segments):
    ids, mask = _expected(tok, segments)
    np.testing.assert_array_equal(got.input_ids, ids)
    np.testing.assert_array_equal(got.loss_mask, mask)


def test_kimi_style_masks_token_by_token(tokenizer):
    """Sample 1: the tool loop with its reasoning, trained on reasoning, tool call and answer,
    not on the tool result; sample 2: the history with emptied <think></think> (untrained),
    then the last turn with its reasoning."""
    tok = kimi_style(tokenizer)
    r = render_conversation(tok, AGENT, 10_000, tools=TOOLS)
    assert [s for s, _ in r.samples] == ["#turn1", "#turn2"] and r.not_rendered == ()
    head = (
        '<|im_system|>tool_declare<|im_middle|>[{"type": "function", "function": {"name": '
        '"weather", "parameters": {}}}]<|im_end|><|im_system|>system<|im_middle|>You are Kimi, '
        "an AI assistant created by Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>What is "
        "the weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    call = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    result = "<|im_system|>weather<|im_middle|>## Return of functions.weather:0\nsunny<|im_end|>"
    _check(
        tok,
        r.samples[0][1],
        [
            (head, 0),
            ("Call the tool.</think>" + call + "<|im_end|>", 1),
            (result + "<|im_assistant|>assistant<|im_middle|><think>", 0),
            ("The tool says sunny.</think>It is sunny.<|im_end|>", 1),
        ],
    )
    history = (
        head
        + "</think>"
        + call
        + "<|im_end|>"
        + result
        + "<|im_assistant|>assistant<|im_middle|><think></think>It is sunny.<|im_end|>"
        + "<|im_user|>user<|im_middle|>And tomorrow?<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think>"
    )
    _check(tok, r.samples[1][1], [(history, 0), ("Guess rain.</think>Rain.<|im_end|>", 1)])
    assert r.reasoning_tokens == sum(
        len(tok.encode(m["reasoning_content"], add_special_tokens=False))
        for m in AGENT
        if "reasoning_content" in m
    )


def test_qwen3_style_masks_token_by_token(tokenizer):
    tok = qwen3_style(tokenizer)
    r = render_conversation(tok, AGENT, 10_000, tools=TOOLS)
    # Qwen3 renders neither tool_call_id nor the tool's name: counted, not guessed.
    assert [s for s, _ in r.samples] == ["#turn1", "#turn2"]
    assert r.not_rendered == ("tool_call_id", "name")
    system = (
        '<|im_start|>system\n# Tools\n<tools>\n{"type": "function", "function": {"name": '
        '"weather", "parameters": {}}}\n</tools><|im_end|>\n'
    )
    user = "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    call = (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    )
    result = "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    _check(
        tok,
        r.samples[0][1],
        [
            (system + user, 0),
            ("<think>\nCall the tool.\n</think>\n\n" + call, 1),
            (result + "<|im_start|>assistant\n", 0),
            ("<think>\nThe tool says sunny.\n</think>\n\nIt is sunny.<|im_end|>\n", 1),
        ],
    )
    history = (
        system
        + user
        + call
        + result
        + "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
        + "<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"
    )
    _check(
        tok,
        r.samples[1][1],
        [(history, 0), ("<think>\nGuess rain.\n</think>\n\nRain.<|im_end|>\n", 1)],
    )
    # last_turn keeps the final sample only.
    last = render_conversation(
        tok, AGENT, 10_000, TemplateSettings(reasoning_samples="last_turn"), TOOLS
    )
    assert len(last.samples) == 1
    np.testing.assert_array_equal(last.samples[0][1].input_ids, r.samples[1][1].input_ids)


def test_instant_mode_and_a_thinking_prompt_that_contradicts_the_data(tokenizer):
    """`thinking: false` on the Kimi-style template: one sample, reasoning rendered nowhere.
    Qwen3 with `enable_thinking: false` prompts with an empty think block that the reasoning
    turn does not extend: the row cannot be masked and says so."""
    kimi = render_conversation(
        kimi_style(tokenizer), AGENT, 10_000, TemplateSettings({"thinking": False}), TOOLS
    )
    assert len(kimi.samples) == 1 and kimi.not_rendered == ("reasoning_content",)
    assert kimi.reasoning_tokens == 0
    with pytest.raises(TemplateMismatch, match="message 1 \\(assistant\\)"):
        render_conversation(
            qwen3_style(tokenizer),
            AGENT,
            10_000,
            TemplateSettings({"enable_thinking": False}),
            TOOLS,
        )


def _outputs(tmp_path, name="out"):
    d = tmp_path / name
    return TokenShardOutputs(
        d / "tokens", d / "manifest.parquet", d / "rejects.jsonl", d / "summary.json"
    )


ROWS = [
    {"id": "field", "messages": AGENT, "tools": TOOLS},
    {
        "id": "inline",
        "messages": [
            {"role": "user", "content": "Spell cat."},
            {"role": "assistant", "content": "<think>Three letters.</think>C A T."},
            {"role": "user", "content": "And dog?"},
            {"role": "assistant", "content": "<think>Also three.</think>D O G."},
        ],
    },
    {
        "id": "plain",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    },
]


def _save(tok, tmp_path, name):
    d = tmp_path / name
    tok.save_pretrained(d)
    return d


def test_shards_hold_each_rows_reasoning_in_the_mask_and_count_it_per_form(tokenizer, tmp_path):
    tok = kimi_style(tokenizer)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    out = _outputs(tmp_path)
    summary = shard_dataset(
        data, _save(tok, tmp_path, "kimi"), out, shard_size=2, max_length=4096, on_bad_row="error"
    )
    manifest = pd.read_parquet(out.manifest)
    assert manifest["sample_id"].tolist() == [
        "field#turn1",
        "field#turn2",
        "inline#turn1",
        "inline#turn2",
        "plain",
    ]
    assert summary["conversations"] == 3 and summary["samples"] == 5
    assert summary["fields_not_rendered"] == {}
    forms = summary["forms"]
    assert forms["reasoning_content"]["rows"] == 1 and forms["reasoning_content"]["samples"] == 2
    assert forms["inline_think"]["rows"] == 1 and forms["inline_think"]["samples"] == 2
    assert forms["tool_calls"]["rows"] == 1 and "plain" not in forms
    samples = {}
    for f in sorted(out.tokens.glob("*.safetensors")):
        shard = read_token_shard(f)
        for i, sid in enumerate(shard.sample_ids):
            ids, mask = shard.sample(i)
            samples[sid] = (tok.decode(ids[mask.astype(bool)]), tok.decode(ids[~mask.astype(bool)]))
    trained = lambda sid: samples[sid][0]  # noqa: E731
    untrained = lambda sid: samples[sid][1]  # noqa: E731
    for text in ("Call the tool.", "The tool says sunny."):
        assert text in trained("field#turn1") and text not in untrained("field#turn1")
        assert text not in trained("field#turn2") + untrained("field#turn2")  # stripped history
    assert "Guess rain." in trained("field#turn2")
    assert "Three letters." in trained("inline#turn1") and "Also three." in trained("inline#turn2")
    assert "Three letters." not in samples["inline#turn2"][0] + samples["inline#turn2"][1]
    assert "<think>" not in trained("inline#turn1")  # split off, rendered once by the template
    assert forms["reasoning_content"]["reasoning_tokens"] == sum(
        len(tok.encode(m["reasoning_content"], add_special_tokens=False))
        for m in AGENT
        if "reasoning_content" in m
    )


def test_a_template_that_ignores_reasoning_is_counted_or_stops_the_run(tokenizer, tmp_path):
    tok_dir = _save(
        with_template(tokenizer, PLAIN, ("<|im_start|>", "<|im_end|>")), tmp_path, "plain"
    )
    rows = [r for r in ROWS if r["id"] != "field"]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    summary = shard_dataset(
        data, tok_dir, _outputs(tmp_path), shard_size=2, max_length=4096, on_bad_row="error"
    )
    assert summary["fields_not_rendered"] == {"reasoning_content": 1}
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["fields_not_rendered"] == {"reasoning_content": 1} and written == summary
    assert summary["forms"]["inline_think"] == {"rows": 1, "samples": 1, "reasoning_tokens": 0}
    with pytest.raises(
        DatasetError,
        match=r"d.jsonl, row 1: .*does not render the row's `reasoning_content`.*on_unrendered",
    ):
        shard_dataset(
            data,
            tok_dir,
            _outputs(tmp_path, "b"),
            shard_size=2,
            max_length=4096,
            on_bad_row="error",
            on_unrendered_field="error",
        )


def test_rows_the_template_raises_on_are_named_rejects(tokenizer, tmp_path):
    raising = PLAIN.replace(
        "{%- for m in messages %}",
        "{%- for m in messages %}{%- if m.role == 'tool' %}"
        "{{ raise_exception('no tool turns here') }}{%- endif %}",
    )
    tok_dir = _save(
        with_template(tokenizer, raising, ("<|im_start|>", "<|im_end|>")), tmp_path, "raising"
    )
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(
        DatasetError,
        match=r"d.jsonl, row 1: the chat template cannot render the row: .*no tool turns here",
    ):
        shard_dataset(
            data, tok_dir, _outputs(tmp_path), shard_size=2, max_length=4096, on_bad_row="error"
        )
    out = _outputs(tmp_path, "skip")
    summary = shard_dataset(data, tok_dir, out, shard_size=2, max_length=4096, on_bad_row="skip")
    rejects = pd.read_json(out.rejects, lines=True)
    assert (
        rejects["source_row"].tolist() == [1]
        and summary["rejected"] == 1
        and summary["conversations"] == 2
    )


def test_a_conversations_samples_never_straddle_the_heldout_split(tokenizer, tmp_path):
    tok = qwen3_style(tokenizer)
    rows = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Answer {i}.", "reasoning_content": "Think."},
                {"role": "user", "content": "More?"},
                {"role": "assistant", "content": "More.", "reasoning_content": "Again."},
            ],
        }
        for i in range(40)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = _outputs(tmp_path)
    shard_dataset(
        data, _save(tok, tmp_path, "qwen"), out, shard_size=8, max_length=4096, on_bad_row="error"
    )
    ids = pd.read_parquet(out.manifest)["sample_id"].tolist()
    assert len(ids) == 80 and all("#turn" in s for s in ids)
    for modulus in (2, 3, 5):
        sides = {}
        for sid in ids:
            sides.setdefault(conversation_of(sid), set()).add(is_heldout(sid, modulus))
        assert all(len(s) == 1 for s in sides.values())
        held = {c for c, s in sides.items() if s == {True}}
        assert 0 < len(held) < 40  # the split does split
        assert held == {c for c in sides if is_heldout(c, modulus)}


def test_chat_template_kwargs_enter_the_digest_and_the_shard_ids(tokenizer, tmp_path):
    tok = kimi_style(tokenizer)
    assert tokenizer_digest(tok) == tokenizer_digest(tok, TemplateSettings())
    old = hashlib.sha256(
        json.dumps(
            {"tokenizer": tok.backend_tokenizer.to_str(), "chat_template": tok.chat_template}
        ).encode()
    ).hexdigest()
    assert tokenizer_digest(tok) == old  # the default leaves existing ids alone
    assert tokenizer_digest(tok, TemplateSettings({"thinking": False})) != old
    data = write_jsonl(tmp_path / "d.jsonl", ROWS[1:])
    tok_dir = _save(tok, tmp_path, "kimi")
    a, b = _outputs(tmp_path, "a"), _outputs(tmp_path, "b")
    shard_dataset(data, tok_dir, a, shard_size=8, max_length=4096, on_bad_row="error")
    shard_dataset(
        data,
        tok_dir,
        b,
        shard_size=8,
        max_length=4096,
        on_bad_row="error",
        template=TemplateSettings({"thinking": False}),
    )
    ma, mb = pd.read_parquet(a.manifest), pd.read_parquet(b.manifest)
    assert set(ma["shard_id"]).isdisjoint(mb["shard_id"])
    assert mb["sample_id"].tolist() == ["inline", "plain"]  # instant mode: one sample each


def test_read_conversations_keeps_tools_and_forms(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    good, bad = read_conversations(data)
    assert not bad and [c.forms for c in good] == [
        ("reasoning_content", "tool_calls"),
        ("inline_think",),
        (),
    ]
    assert good[0].tools == tuple(TOOLS) and good[1].tools == ()


def test_regeneration_names_tool_rows_it_cannot_answer_and_keeps_user_fields(tmp_path):
    """Regeneration drops the assistant turns; a row with tool traffic would keep tool results
    whose calls are gone, so it is a named reject, never silently regenerated."""
    from eagleflow.regenerate.replies import TOOL_ROWS, regenerate_conversations

    named = {"id": "named", "messages": [{"role": "user", "content": "Hi", "name": "ann"}]}
    data = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], named])
    convs, bad = read_conversations(data, require_assistant=False)
    seen = []

    def render(messages):
        seen.append(messages)
        return [1, 2, 3]

    rows, bad, stats = regenerate_conversations(convs, lambda p: ["ok"] * len(p), render, 100)
    assert [(b.source_row, b.reason) for b in bad] == [(1, TOOL_ROWS)]
    assert rows == [
        {
            "id": "named",
            "messages": [
                {"role": "user", "content": "Hi", "name": "ann"},
                {"role": "assistant", "content": "ok"},
            ],
        }
    ]
    assert seen == [[{"role": "user", "content": "Hi", "name": "ann"}]]
    assert stats["rejected"] == 1


def test_truncation_drops_a_later_sample_and_counts_it(tokenizer, tmp_path):
    """A sample whose truncation leaves no loss token is not kept, and is counted; the row
    stays while one of its samples has loss tokens."""
    tok = kimi_style(tokenizer)
    full = render_conversation(tok, normalize_messages(ROWS[1]), 10_000)
    first, second = (t for _, t in full.samples)
    cut = int(np.flatnonzero(second.loss_mask)[0])  # the second sample's first trained token
    assert cut > int(np.flatnonzero(first.loss_mask)[0])
    short = render_conversation(tok, normalize_messages(ROWS[1]), cut)
    assert [s for s, _ in short.samples] == ["#turn1"] and short.dropped_samples == 1
    data = write_jsonl(tmp_path / "d.jsonl", [ROWS[1]])
    summary = shard_dataset(
        data,
        _save(tok, tmp_path, "kimi"),
        _outputs(tmp_path),
        shard_size=2,
        max_length=cut,
        on_bad_row="error",
    )
    assert summary["samples"] == 1 and summary["samples_truncated_away"] == 1


@pytest.mark.slow
def test_the_shard_rule_counts_or_refuses_fields_its_template_ignores(tmp_path):
    """Through Snakemake, sharding only (the untrained embedded target, whose template renders
    role and content): the summary names the fields it ignores; `on_unrendered_field: error`
    stops the run in one sentence naming field and row."""
    from support.workflow_runner import snakemake

    data = write_jsonl(tmp_path / "mixed.jsonl", ROWS)
    config = {"data": {"path": str(data), "shard_size": 4}}
    snakemake(tmp_path, "results/shards/manifest.parquet", config=config)
    summary = json.loads((tmp_path / "results" / "shards" / "summary.json").read_text())
    assert summary["conversations"] == 3 and summary["samples"] == 3
    assert summary["fields_not_rendered"] == {
        "reasoning_content": 2,
        "tool_calls": 1,
        "tool_call_id": 1,
        "name": 1,
        "tools": 1,
    }
    assert summary["forms"]["tool_calls"]["rows"] == 1
    strict = tmp_path / "strict"
    strict.mkdir()
    config["data"]["on_unrendered_field"] = "error"
    proc = snakemake(strict, "results/shards/manifest.parquet", config=config, check=False)
    assert proc.returncode != 0
    log = (strict / "results" / "logs" / "shard.log").read_text()
    assert (
        "mixed.jsonl, row 1: the chat template does not render the row's `reasoning_content`" in log
    )


def test_chat_template_kwargs_reach_regeneration_evaluation_and_the_fingerprints(
    tokenizer, tmp_path
):
    from eagleflow.evaluate.acceptance import load_prompts
    from eagleflow.extract.fingerprint import extraction_fingerprint
    from eagleflow.regenerate.replies import chat_renderer
    from eagleflow.regenerate.sources import regeneration_identity

    tok = kimi_style(tokenizer)
    think, empty = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    prompt = [{"role": "user", "content": "Hi"}]
    assert chat_renderer(tok)(prompt)[-1] == think  # thinking mode by default
    assert chat_renderer(tok, {"thinking": False})(prompt)[-2:] == [think, empty]
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"id": f"p{i}", "turns": [f"Q{i}?"]} for i in range(4)]
    )
    tok_dir = _save(tok, tmp_path, "kimi")
    default = load_prompts(data, tok_dir, limit=4, modulus=2)
    instant = load_prompts(
        data, tok_dir, limit=4, modulus=2, chat_template_kwargs={"thinking": False}
    )
    assert default and [p["sample_id"] for p in default] == [p["sample_id"] for p in instant]
    assert all(p["prompt_token_ids"][-1] == think for p in default)
    assert all(p["prompt_token_ids"][-2:] == [think, empty] for p in instant)
    # Source shard ids and the extraction fingerprint: unchanged without kwargs, new with.
    target = {"config.json": "x"}
    assert regeneration_identity(target, 8, 512, True, {}) == regeneration_identity(
        target, 8, 512, True
    )
    assert "chat_template_kwargs" not in regeneration_identity(target, 8, 512, True)
    assert regeneration_identity(target, 8, 512, True, {"thinking": False})["chat_template_kwargs"]
    args = (target, [2, 4, 5, 8], "vllm", 512, "bfloat16", "auto", "0.32.0", "bfloat16")
    old, record = extraction_fingerprint(*args)
    assert extraction_fingerprint(*args, {})[0] == old and "chat_template_kwargs" not in record
    new, record = extraction_fingerprint(*args, {"thinking": False})
    assert new != old and record["chat_template_kwargs"] == {"thinking": False}


def test_the_published_kimi_history_rule_is_reported_not_guessed(tokenizer):
    """Kimi-K2-Thinking's published rule keeps reasoning only after the last assistant turn
    without tool calls: a finished answer's reasoning is rendered nowhere (counted), and a
    tool loop that ends in an answer empties the loop's reasoning once the answer follows, so
    the answer's tokens cannot be told from its context (a named reject, not a guess)."""
    from support.chat_templates import kimi_published_rule, kimi_tokens

    tok = with_template(tokenizer, kimi_published_rule(), kimi_tokens())
    answer = normalize_messages(ROWS[1])[:2]
    r = render_conversation(tok, answer, 10_000)
    assert len(r.samples) == 1 and r.not_rendered == ("reasoning_content",)
    with pytest.raises(TemplateMismatch, match="message 3 \\(assistant\\)"):
        render_conversation(tok, AGENT, 10_000, tools=TOOLS)
    # The loop itself, before its answer, trains on its reasoning and tool call.
    loop = render_conversation(tok, AGENT[:3], 10_000, tools=TOOLS)
    trained = tok.decode(loop.samples[0][1].input_ids[loop.samples[0][1].loss_mask == 1])
    assert trained.startswith("Call the tool.</think><|tool_calls_section_begin|>")


def _prompt_rows():
    return [
        {"id": "two", "turns": ["What is 2 plus 2?", "And 3 plus 3?"]},
        {"id": "one", "turns": ["Spell cat."]},
    ]


def test_replies_cut_by_the_budget_are_counted_kept_or_dropped(tmp_path):
    from eagleflow.regenerate.replies import ReplyForm, regenerate_conversations

    data = write_jsonl(tmp_path / "d.jsonl", _prompt_rows())
    convs, _ = read_conversations(data, require_assistant=False)

    def generate(prompts):  # the second turn of "two" and the only turn of "one" run out
        return [
            ("cut" if len(p) != 1 else "done", "length" if len(p) != 1 else "stop") for p in prompts
        ]

    def render(messages):
        return [0] * len(messages) if messages[0]["content"].startswith("What") else [0, 0]

    rows, bad, stats = regenerate_conversations(convs, generate, render, 100)
    assert stats["truncated"] == 2 and stats["truncated_dropped"] == 0 and not bad
    assert [len(r["messages"]) for r in rows] == [4, 2]
    rows, bad, stats = regenerate_conversations(
        convs, generate, render, 100, form=ReplyForm(on_truncated="drop")
    )
    assert stats["truncated"] == 2 and stats["truncated_dropped"] == 2
    assert rows == [
        {
            "id": "two",
            "messages": [
                {"role": "user", "content": "What is 2 plus 2?"},
                {"role": "assistant", "content": "done"},
            ],
        }
    ]
    assert [(b.source_row, b.reason) for b in bad] == [
        (
            2,
            "the first reply was cut at data.regenerate.max_new_tokens, and "
            "`data.regenerate.on_truncated: drop` drops it",
        )
    ]


@pytest.mark.slow  # imports vLLM (its reasoning parsers), no engine
def test_thinking_replies_split_by_vllms_parser_re_render_to_the_generated_tokens(
    tokenizer, tmp_path
):
    """Regeneration in thinking mode, the engine replaced by replies written out: each reply is
    `reasoning</think>answer` after the replica-style prompt's <think>; vLLM's kimi_k2 parser
    splits it, and the rows, sharded, render each turn's sample as exactly the prompt the
    target was given plus the tokens it generated (history as the template renders it)."""
    from eagleflow.regenerate.replies import (
        ReplyForm,
        chat_renderer,
        conversation_renderer,
        reasoning_splitter,
        regenerate_conversations,
    )

    tok = kimi_style(tokenizer)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    data = write_jsonl(tmp_path / "d.jsonl", _prompt_rows())
    convs, _ = read_conversations(data, require_assistant=False)
    render = chat_renderer(tok)
    generated = []  # (prompt ids, generated ids) in order

    def generate(prompts):
        out = []
        for p in prompts:
            k = len(generated)
            text = f"Step {k}: add them.</think>It is {k}."
            generated.append((list(p), tok.encode(text, add_special_tokens=False) + [end]))
            out.append((text, "stop", generated[-1][1]))
        return out

    split = reasoning_splitter("kimi_k2", tok)
    # vLLM's parser strips the reasoning's trailing whitespace; kept as generated, found
    # through vLLM on the replica (a reply cut at the budget after a space)
    assert split("1 1 1 ") == ("1 1 1 ", None) and split("r </think> ans ") == ("r ", " ans ")
    assert split("Think.</think>It is.") == ("Think.", "It is.")
    form = ReplyForm(split, rerender=conversation_renderer(tok))
    rows, bad, stats = regenerate_conversations(convs, generate, render, 1000, form=form)
    assert not bad and stats["replies"] == 3
    assert stats["rerendered"] == {"exact": 3, "cut": 0, "mismatched": 0}
    assert rows[0]["messages"][1] == {
        "role": "assistant",
        "content": "It is 0.",
        "reasoning_content": "Step 0: add them.",
    }
    samples = {}
    for row in rows:
        r = render_conversation(tok, normalize_messages(row), 10_000)
        samples.update({row["id"] + s: t for s, t in r.samples})
    assert sorted(samples) == ["one", "two#turn1", "two#turn2"]
    by_prompt = {tuple(p): g for p, g in generated}
    for sid, t in samples.items():
        first = int(np.flatnonzero(t.loss_mask)[0])
        prompt = tuple(int(x) for x in t.input_ids[:first])
        assert prompt in by_prompt, sid  # the context the target was given
        np.testing.assert_array_equal(t.input_ids[first:], by_prompt[prompt])
        assert t.loss_mask[first:].all()


def test_a_reply_that_does_not_render_back_to_its_tokens_is_counted_and_named(tokenizer, tmp_path):
    """Found through vLLM on the barely trained replica: a reply that ends its turn without
    closing its think block (`<|im_end|>` right after the prompt's `<think>`) renders back with
    a `</think>` the target never wrote. The job's check counts it and names the row and reply;
    a reply cut at the budget is checked as a prefix (the template closes it)."""
    from eagleflow.regenerate.replies import (
        ReplyForm,
        chat_renderer,
        conversation_renderer,
        regenerate_conversations,
        rerender_check,
    )

    tok = kimi_style(tokenizer)
    end, close = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("</think>")
    data = write_jsonl(tmp_path / "d.jsonl", _prompt_rows())
    convs, _ = read_conversations(data, require_assistant=False)
    words = tok.encode("Some steps", add_special_tokens=False)

    def generate(prompts):  # "two": an unclosed think block then the end; "one": cut
        return [
            ("", "stop", [end]) if len(prompts) == 2 and k == 0 else ("Some steps", "length", words)
            for k, _ in enumerate(prompts)
        ]

    def split(text):
        return (text, None) if "</think>" not in text else tuple(text.split("</think>", 1))

    logged = []
    form = ReplyForm(split, rerender=conversation_renderer(tok))
    _, _, stats = regenerate_conversations(
        convs, generate, chat_renderer(tok), 1000, logged.append, form
    )
    assert stats["rerendered"] == {"exact": 0, "cut": 2, "mismatched": 1}
    assert any(
        m.startswith("two, reply 1: the written-out reply does not render back") and "token 0" in m
        for m in logged
    ), logged
    prompt = [1, 2, 3]
    assert rerender_check(prompt, [close, end], [1, 2, 3, close, end], "stop") is None
    assert rerender_check(prompt, [close], [1, 2, 3, close, end], "length") is None
    assert rerender_check(prompt, [end], [1, 2, 3, close, end], "stop") == 0
    assert rerender_check(prompt, [close, end], [1, 2, 3, close], "stop") == 1


def test_tool_rows_are_answered_where_the_dataset_has_its_assistant_turns():
    """Tool rows: the target answers wherever the row has an assistant turn (after the user
    turn, after the tool result, after the next user turn), with the dataset's turn it replaces;
    calls compare by name, arguments as JSON values and ids where both have one."""
    from eagleflow.data.conversations import Conversation
    from eagleflow.regenerate.replies import answer_points, same_calls

    agent = Conversation("a", normalize_messages({"messages": AGENT}), "f", 1, tuple(TOOLS))
    points = answer_points(agent, True)
    assert [([m["role"] for m in turns], given) for turns, given in points] == [
        (["user"], AGENT[1]),
        (["tool"], AGENT[3]),
        (["user"], AGENT[5]),
    ]
    assert points[1][0] == [AGENT[2]]  # the tool result as given
    # ending on a tool result: the target answers it
    assert answer_points(Conversation("b", tuple(AGENT[:3]), "f", 2), True)[-1] == (
        [AGENT[2]],
        None,
    )
    # without tool traffic: after each user turn, as before
    plain = normalize_messages(ROWS[1])
    assert [given for _, given in answer_points(Conversation("c", plain, "f", 3), False)] == [
        None,
        None,
    ]
    as_object = {**CALL, "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    assert same_calls([CALL], [as_object]) and same_calls([CALL], [{**CALL, "id": None}])
    assert not same_calls([CALL], [{**CALL, "id": "functions.weather:1"}])
    other = {**CALL, "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    assert not same_calls([CALL], [other]) and not same_calls([CALL], []) and same_calls([], [])


@pytest.mark.slow  # imports vLLM (its reasoning and tool parsers), no engine
def test_tool_rows_are_regenerated_turn_by_turn_and_end_where_the_targets_calls_differ(
    tokenizer, tmp_path
):
    """Regeneration of tool rows in thinking mode, the engine replaced by replies written out
    and split by vLLM's kimi_k2 reasoning and tool parsers. A row whose first reply makes the
    dataset's call keeps the dataset's tool result and is answered to its end, every reply
    rendering back to its generated tokens and every sample to the prompt the target was given
    plus those tokens. A row whose first reply makes no call ends with that reply (its tool
    result answers nothing the target asked), counted and named. Without a tool parser, tool
    rows are named rejects."""
    from eagleflow.regenerate.replies import (
        TOOL_ROWS,
        ReplyForm,
        chat_renderer,
        conversation_renderer,
        reasoning_splitter,
        regenerate_conversations,
        tool_splitter,
    )

    tok = kimi_style(tokenizer)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rome = [{**AGENT[0], "content": "What is the weather in Rome?"}, *AGENT[1:]]
    rows_in = [
        {"id": "paris", "messages": AGENT, "tools": TOOLS},
        {"id": "rome", "messages": rome, "tools": TOOLS},
    ]
    convs, _ = read_conversations(write_jsonl(tmp_path / "d.jsonl", rows_in))
    call_text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    generated = []

    def generate(prompts):
        out = []
        for p in prompts:
            text = tok.decode(p)
            turn = text.count("<|im_assistant|>")  # the generation prompt's included
            if turn == 1:
                reply = "No tool.</think>Sunny." if "Rome" in text else "Look.</think>" + call_text
            else:
                reply = "Sunny it is.</think>Sunny." if turn == 2 else "Guess.</think>Rain."
            generated.append((list(p), tok.encode(reply, add_special_tokens=False) + [end]))
            out.append((reply, "stop", generated[-1][1]))
        return out

    logged = []
    form = ReplyForm(
        reasoning_splitter("kimi_k2", tok),
        rerender=conversation_renderer(tok),
        calls=tool_splitter("kimi_k2", tok),
    )
    rows, bad, stats = regenerate_conversations(
        convs, generate, chat_renderer(tok), 10_000, logged.append, form
    )
    assert not bad and stats["replies"] == 4 and stats["tool_calls_diverged"] == 1
    assert stats["rerendered"] == {"exact": 4, "cut": 0, "mismatched": 0}
    paris, rome_row = rows
    assert paris["tools"] == TOOLS and [m["role"] for m in paris["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert paris["messages"][1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Look.",
        "tool_calls": [CALL],
    }
    assert paris["messages"][2] == AGENT[2]  # the user's tool result, as given
    assert rome_row["messages"] == [
        rome[0],
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "No tool."},
    ]
    assert any(m.startswith("rome, reply 1: the target's tool calls are not") for m in logged)
    r = render_conversation(tok, normalize_messages(paris), 10_000, tools=TOOLS)
    by_prompt = {tuple(p): g for p, g in generated}
    assert [s for s, _ in r.samples] == ["#turn1", "#turn2"]
    for _, t in r.samples:  # each trained span: a reply exactly as generated after its prompt
        starts = np.flatnonzero(np.diff(np.concatenate([[0], t.loss_mask])) == 1)
        ends = np.flatnonzero(np.diff(np.concatenate([t.loss_mask, [0]])) == -1) + 1
        for a, b in zip(starts, ends):
            prompt = tuple(int(x) for x in t.input_ids[:a])
            assert prompt in by_prompt
            np.testing.assert_array_equal(t.input_ids[a:b], by_prompt[prompt])
    rows, bad, _ = regenerate_conversations(
        convs,
        generate,
        chat_renderer(tok),
        10_000,
        form=ReplyForm(reasoning_splitter("kimi_k2", tok)),
    )
    assert rows == [] and [(b.source_row, b.reason) for b in bad] == [
        (1, TOOL_ROWS),
        (2, TOOL_ROWS),
    ]


def test_the_replica_prompts_the_target_as_the_published_kimi_template_does(tokenizer):
    """Kimi-K2.5's history rule on the replica: before every assistant turn of a conversation
    of answers and tool loops, the prompt the target reads (generation prompt included) is the
    same under the replica's template and under the published rule: every earlier assistant
    turn with an empty `<think></think>`, the turns of the tool loop being written with their
    reasoning, and `<think>` opened for the reply. (They differ only on a finished answer
    rendered as text, where the published rule drops its reasoning: the test above.)"""
    from support.chat_templates import kimi_published_rule, kimi_tokens

    replica = kimi_style(tokenizer)
    published = with_template(tokenizer, kimi_published_rule(), kimi_tokens())
    sunday = {**CALL, "id": "functions.weather:1"}
    conversation = [
        *AGENT,
        {"role": "user", "content": "And Sunday?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Ask again.",
            "tool_calls": [sunday],
        },
        {
            "role": "tool",
            "content": "cold",
            "tool_call_id": "functions.weather:1",
            "name": "weather",
        },
        {"role": "assistant", "content": "Cold.", "reasoning_content": "The tool says cold."},
    ]
    turns = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    for i in turns:
        prompt = [
            tok.apply_chat_template(
                conversation[:i], tools=TOOLS, add_generation_prompt=True, tokenize=False
            )
            for tok in (replica, published)
        ]
        assert prompt[0] == prompt[1], i
        text = prompt[0]
        assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
        last_user = max(j for j in range(i) if conversation[j]["role"] == "user")
        for j in turns:
            if j >= i:
                break
            reasoning = conversation[j]["reasoning_content"]
            # history before the last user turn: emptied; the loop being written: kept
            assert (f"<think>{reasoning}</think>" in text) == (j > last_user), (i, j)
        assert text.count("<think></think>") == sum(j < last_user for j in turns if j < i)
