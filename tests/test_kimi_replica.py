"""The tiny Kimi-K2.5 replica (eagleflow.embedded.tiny_kimi) without vLLM: its tokenizer is code
that runs only when trusted, its template (no `{% generation %}` markers) gives assistant masks
that match spans known by construction, the bundled dataset's masks through it hold only
assistant text, and its wrapped weights load into an independent transformers forward.
(The whole pipeline on it, vLLM included: `snakemake --configfile
config/examples/tiny-kimi-k25.yaml`, docs/support-matrix.md.)"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagleflow.data.templating import has_generation_markers, tokenize_conversation
from eagleflow.embedded import tiny_kimi
from eagleflow.embedded.bundled_data import generate_conversations
from eagleflow.embedded.train_target import first_reply_loss
from eagleflow.target.info import TargetError, read_target
from eagleflow.target.load import check_remote_code, load_tokenizer, remote_code_files

BUNDLED = generate_conversations(300, seed=1)


@pytest.fixture(scope="module")
def kimi_text(tmp_path_factory):
    """Untrained text model + Kimi tokenizer (plain DeepseekV3 directory), base vocab 512."""
    d = tmp_path_factory.mktemp("kimi") / "text"
    texts = [m["content"] for r in BUNDLED for m in r["messages"]]
    return tiny_kimi.build_text_model(texts, d, base_vocab=512, num_hidden_layers=2)


@pytest.fixture(scope="module")
def kimi(kimi_text):
    return tiny_kimi.wrap(kimi_text, kimi_text.parent / "tiny-kimi-k25")


@pytest.fixture(scope="module")
def tok(kimi):
    return load_tokenizer(kimi)


def test_the_tokenizer_is_code_that_runs_only_when_trusted(kimi, tok):
    assert [f.name for f in remote_code_files(kimi)] == ["tokenization_kimi.py"]
    with pytest.raises(
        TargetError, match=r"tokenization_kimi.py.*`target.trust_remote_code: true`"
    ):
        check_remote_code(kimi, trust=False)
    check_remote_code(kimi, trust=True)
    assert type(tok).__name__ == "TikTokenTokenizer"
    cfg = json.loads((kimi / "tokenizer_config.json").read_text())
    assert cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    # Kimi's layout: 256 special ids after the base vocabulary, role markers among them.
    base = len((kimi / "tiktoken.model").read_text().splitlines())
    assert base >= 512 and len(tok) == base + 256
    for marker in (*tiny_kimi.ROLE_MARKERS, *tiny_kimi.TOOL_MARKERS, "<think>", "</think>"):
        assert tok.convert_tokens_to_ids(marker) >= base
    text = "héllo 世界, 27 plus 97 is 124."
    assert tok.decode(tok(text)["input_ids"]) == text


def test_the_fingerprint_hashes_the_shipped_code(kimi, tmp_path):
    import shutil

    from eagleflow.extract.fingerprint import target_identity

    copy = tmp_path / "copy"
    shutil.copytree(kimi, copy)
    before = target_identity(copy)
    assert set(before["code"]) == {"tokenization_kimi.py"}
    with open(copy / "tokenization_kimi.py", "a") as f:
        f.write("\n# changed\n")
    assert target_identity(copy)["code"] != before["code"]


def _expected(tok, messages):
    """ids and mask by construction: each turn's header (role marker, role name, <|im_middle|>,
    and the <think> the generation prompt opens, thinking mode) is unmasked; an assistant
    turn's </think> (written by the model: no reasoning here), content and <|im_end|> are
    masked. Content sits between special tokens, so it tokenizes alone."""
    sp = tok.convert_tokens_to_ids
    ids, mask = [], []

    def add(piece, m):
        ids.extend(piece)
        mask.extend([m] * len(piece))

    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": tiny_kimi.DEFAULT_SYSTEM}, *messages]
    for msg in messages:
        role = msg["role"]
        marker = {"system": "<|im_system|>", "user": "<|im_user|>"}.get(role, "<|im_assistant|>")
        header = [sp(marker), *tok.encode(role, add_special_tokens=False), sp("<|im_middle|>")]
        if role == "assistant":
            header += [sp("<think>")]
        add(header, 0)
        body = tok.encode(msg["content"], add_special_tokens=False) + [sp("<|im_end|>")]
        if role == "assistant":
            body = [sp("</think>"), *body]
        add(body, int(role == "assistant"))
    return np.array(ids), np.array(mask, dtype=np.uint8)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Spell cat."},
            {"role": "assistant", "content": "C A T."},
            {"role": "user", "content": "And dog?"},
            {"role": "assistant", "content": "D O G.\n"},
        ],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": " leading space, trailing newline\n\n"},
            {"role": "user", "content": "<|im_end|> typed by a user"},
            {"role": "assistant", "content": "世界"},
        ],
    ],
)
def test_masks_without_generation_markers_match_spans_known_by_construction(tok, messages):
    assert not has_generation_markers(tok)
    t = tokenize_conversation(tok, messages, max_length=10_000)
    ids, mask = _expected(tok, messages)
    np.testing.assert_array_equal(t.input_ids, ids)
    np.testing.assert_array_equal(t.loss_mask, mask)


def test_bundled_masks_through_the_replica_template_hold_only_assistant_text(tok):
    """Every bundled conversation: the masked tokens decode to the assistant replies, each
    opened by </think> (the empty reasoning the model writes after the prompt's <think>) and
    ended by <|im_end|>, in order; no header or user text is trained on."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for row in BUNDLED:
        t = tokenize_conversation(tok, row["messages"], max_length=10_000)
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert t.loss_mask.any()
        # One masked run per reply, each ending at <|im_end|>.
        edges = np.flatnonzero(np.diff(np.r_[0, t.loss_mask, 0]))
        runs = list(zip(edges[::2], edges[1::2]))
        assert len(runs) == len(replies), row
        for (a, b), reply in zip(runs, replies):
            assert t.input_ids[b - 1] == end
            assert tok.convert_ids_to_tokens(int(t.input_ids[a])) == "</think>"
            assert tok.decode(t.input_ids[a + 1 : b - 1]) == reply
            assert tok.convert_ids_to_tokens(int(t.input_ids[a - 1])) == "<think>"


def test_the_wrapped_layout_names_and_loads_the_text_model(kimi, kimi_text):
    import torch
    from transformers import AutoModelForCausalLM

    from eagleflow.target.head import EMBED, LM_HEAD, NORM, read_target_tensor
    from eagleflow.target.load import load_causal_lm

    info = read_target(kimi)
    assert info.wrapper == "KimiK25ForConditionalGeneration" and info.is_mla
    assert (info.text_config["kv_lora_rank"], info.text_config["qk_rope_head_dim"]) == (512, 64)
    assert (info.text_config["topk_method"], info.text_config["scoring_func"]) == (
        "noaux_tc",
        "sigmoid",
    )
    cfg = json.loads((kimi / "config.json").read_text())
    assert cfg["text_config"]["model_type"] == "kimi_k2" and "vision_config" in cfg
    index = json.loads((kimi / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == tiny_kimi.NUM_SHARDS
    assert all(n.startswith(("language_model.model.", "language_model.lm_head.")) for n in index)
    for name in (NORM, LM_HEAD, EMBED):
        assert f"language_model.{name}" in index
        assert read_target_tensor(kimi, name).shape[-1] == info.hidden_size
    wrapped = load_causal_lm(kimi, torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(kimi_text, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.equal(wrapped(ids).logits, plain(ids).logits)


@pytest.mark.parametrize("embedded", [False, True])
def test_the_workflow_refuses_shipped_code_before_the_dag(kimi, tmp_path, embedded):
    """`target.trust_remote_code` off: one sentence naming the key, before any job runs (the
    embedded replica is refused before it is even built)."""
    from support.workflow_runner import snakemake

    path = "resources/targets/tiny-kimi-k25" if embedded else str(kimi)
    cfg = {"target": {"path": path, "trust_remote_code": False}}
    proc = snakemake(tmp_path, "-n", config=cfg, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "set `target.trust_remote_code: true`" in out, out[-2000:]
    assert not (tmp_path / "resources").exists()


def test_int4_packing_is_compressed_tensors_pack_quantized():
    """The probe's int4 experts (docs/support-matrix.md): eight 4-bit values per int32, lowest
    bits first, offset by 8; one scale per 32 inputs; dequantized within half a step."""
    from support.int4_experts import pack_int4

    w = torch.randn(64, 128)
    packed, scale, shape = pack_int4(w)
    assert packed.dtype == torch.int32 and packed.shape == (64, 16)
    assert scale.dtype == torch.bfloat16 and scale.shape == (64, 4)
    assert shape.tolist() == [64, 128]
    q = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], -1).reshape(64, 128) - 8
    deq = (q.reshape(64, 4, 32).float() * scale.float()[..., None]).reshape(64, 128)
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= 0.5 * step + 1e-2 * w.abs()).all()


class _BagOfPromptTokens(torch.nn.Module):
    """Logits that favour every token already in the input (a model that reads its prompt),
    or, with `blind`, the same logits whatever the input (one that does not)."""

    def __init__(self, vocab: int, blind: bool):
        super().__init__()
        self.vocab, self.blind = vocab, blind

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        if not self.blind:
            logits[0, -1, input_ids[0].unique()] = 5.0
        return SimpleNamespace(logits=logits)


def test_first_reply_loss_tells_a_model_that_reads_its_prompt_from_one_that_does_not(tok):
    """The replica's prompt-dependence figure (train_target.first_reply_loss), through Kimi's
    template: each reply starts with its prompt's first word (no space before it in either)."""
    words = ["apple", "zebra", "violet", "copper", "meadow", "falcon"]
    convs = [
        SimpleNamespace(
            messages=(
                {"role": "user", "content": f"{w}?"},
                {"role": "assistant", "content": f"{w}."},
            )
        )
        for w in words
    ]
    reads = first_reply_loss(_BagOfPromptTokens(len(tok), blind=False), tok, convs)
    blind = first_reply_loss(_BagOfPromptTokens(len(tok), blind=True), tok, convs)
    assert reads["conversations"] == blind["conversations"] == len(words)
    assert reads["own_prompt"] < reads["other_prompt"] - 1.0, reads
    assert blind["own_prompt"] == blind["other_prompt"], blind


def test_the_empty_system_phase_renders_an_empty_turn_in_place_of_the_default_one(tok):
    """The replica's first training phase (tiny_kimi.with_empty_system_turn): Kimi's template
    renders an empty system turn instead of its default one, the assistant tokens and their
    mask stay the same, and a conversation with its own system turn is left as it is."""
    from eagleflow.data.conversations import Conversation

    msgs = ({"role": "user", "content": "Spell cat."}, {"role": "assistant", "content": "C A T."})
    own = ({"role": "system", "content": "Be brief."}, *msgs)
    convs = [Conversation("a", msgs, "f", 1), Conversation("b", own, "f", 2)]
    plain, already = tiny_kimi.with_empty_system_turn(convs)
    assert already == convs[1]
    default = tokenize_conversation(tok, convs[0].messages, 256)
    empty = tokenize_conversation(tok, plain.messages, 256)
    assert tiny_kimi.DEFAULT_SYSTEM in tok.decode(default.input_ids)
    text = tok.decode(empty.input_ids)
    assert tiny_kimi.DEFAULT_SYSTEM not in text
    assert text.startswith("<|im_system|>system<|im_middle|><|im_end|><|im_user|>")
    assert len(empty.input_ids) < len(default.input_ids)
    assert np.array_equal(
        default.input_ids[default.loss_mask == 1], empty.input_ids[empty.loss_mask == 1]
    )


def test_the_replica_talks_like_k25_thinking_by_default_with_kimis_tool_call_tokens(tok):
    """Thinking mode by default: the generation prompt opens <think>, the turn being written
    keeps its reasoning, history gets an empty <think></think>; tool calls in Kimi's markers,
    each one token; `thinking: false` is instant mode."""
    from eagleflow.data.templating import TemplateSettings, render_conversation

    call = {"id": "functions.f:0", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Use f."},
        {"role": "assistant", "content": "", "reasoning_content": "Call f.", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "functions.f:0", "name": "f"},
        {"role": "assistant", "content": "42.", "reasoning_content": "It said 42."},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "Sure."},
    ]
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    r = render_conversation(tok, messages, 10_000)
    assert [s for s, _ in r.samples] == ["#turn1", "#turn2"] and r.not_rendered == ()
    first, second = (t for _, t in r.samples)
    trained = tok.decode(first.input_ids[first.loss_mask == 1])
    assert trained == (
        "Call f.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "It said 42.</think>42.<|im_end|>"
    )
    for marker in tiny_kimi.TOOL_MARKERS:
        assert (first.input_ids == tok.convert_tokens_to_ids(marker)).sum() == 1
    text = tok.decode(second.input_ids)
    assert "Call f." not in text and "It said 42." not in text
    assert "<think></think>42.<|im_end|>" in text
    assert tok.decode(second.input_ids[second.loss_mask == 1]) == "Sure.</think>Yes.<|im_end|>"
    instant = render_conversation(tok, messages, 10_000, TemplateSettings({"thinking": False}))
    assert len(instant.samples) == 1 and instant.not_rendered == ("reasoning_content",)


def test_the_agent_families_reason_and_call_tools_through_the_replica_template(tok):
    """`reasoning` and `tool_lookup` (drawn only when named): each row one sample on the
    replica's template, its reasoning and tool call inside the mask; the default corpus is
    unchanged by their existence."""
    from eagleflow.data.conversations import normalize_messages
    from eagleflow.data.templating import render_conversation

    assert generate_conversations(300, seed=1) == BUNDLED
    rows = generate_conversations(40, seed=3, families=["reasoning", "tool_lookup"])
    assert {r["family"] for r in rows} == {"reasoning", "tool_lookup"}
    inline = 0
    for row in rows:
        inline += "<think>" in row["messages"][-1]["content"]
        messages = normalize_messages(row)
        r = render_conversation(tok, messages, 10_000)
        assert len(r.samples) == 1 and r.not_rendered == (), row
        t = r.samples[0][1]
        trained = tok.decode(t.input_ids[t.loss_mask == 1])
        for m in messages:
            if m["role"] == "assistant":
                assert m["reasoning_content"] + "</think>" + m["content"] in trained
        if row["family"] == "tool_lookup":
            assert "<|tool_call_begin|>functions.lookup_capital:0" in trained
            assert "## Return of" not in trained
    assert 0 < inline < sum(r["family"] == "reasoning" for r in rows)


def test_a_tokenizer_rebuilt_at_the_same_path_loads_its_own_ranks(tmp_path, monkeypatch):
    """Found through the workflow (tests/test_kimi_traffic.py): tiktoken's `load_tiktoken_bpe`
    caches a vocabulary file under its path alone, so a replica rebuilt at
    resources/targets/tiny-kimi-k25 (another corpus, other ranks) was tokenized with the ranks
    of an older one. The shipped tokenizer reads its file itself."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    rel = tiny_kimi.Path("resources/targets/tiny-kimi-k25")
    text = "capital of Peru"
    ids = []
    for corpus in (["the capital of Peru is Lima"] * 20, ["zzz yyy xxx"] * 20):
        tiny_kimi.write_tokenizer(rel, tiny_kimi.tiktoken_ranks(corpus, base_vocab=300))
        tok = tiny_kimi.load_tokenizer(rel)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        ids.append(tok.encode(text, add_special_tokens=False))
    assert len(ids[0]) < len(ids[1])  # the second corpus never saw these words
