"""The target's replies: conversations answered in rounds, and the generators that answer them.

A draft is judged by how often it guesses what the *target* says, so it should learn from the
target's outputs rather than from whoever wrote the dataset (the EAGLE-3 authors and SpecForge
regenerate responses the same way). Every conversation keeps its system and user turns; its
assistant turns are dropped and each user turn is answered by the target, greedily, through
vLLM (`LLM.generate`), with the target's own earlier replies in the context. Round r answers
the r-th user turn of every conversation of a chunk in one batched `generate` call.

Prompt-only datasets (a list of user turns per row: MT-Bench's `{"question_id", "turns"}`, or
`messages` without assistant turns) are read the same way and come out completed.

**Tool traffic** (a row with `tools`, tool calls or tool results) is regenerated turn by turn
where the dataset has its assistant turns: the target answers each user turn and each run of
tool results, with the row's tools, system, user turns and tool results as given (they are the
user's data) and its own earlier replies as history. A reply is split by vLLM's tool parser of
the target's family (`data.regenerate.tool_parser`) into `content` + `tool_calls`. The dataset's
tool results answer the dataset's calls only: when the target's reply does not make exactly the
calls of the dataset's turn it replaces (the same names, arguments and ids), the reply is kept
as the row's last turn (its context is real, and it is what the target says there) and the rest
of the row is dropped, counted as `tool_calls_diverged` and named in the log. Without a tool
parser the target's calls cannot be compared, so such a row is a named reject (TOOL_ROWS).

A job's replies come from a `Generator`: over an engine of its own (`vllm_generator`) or over
the shared generate engine server (`served_generator`, docs/engine-reuse.md), which computes
them with the same `generate_replies` call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

from eagleflow.data.conversations import BadRow, Conversation
from eagleflow.engine.settings import EngineSettings
from eagleflow.serve.client import EngineClient, ServerSpec

# The generate engine server's entry point, started by the first job that needs it.
GENERATE_SERVER = "eagleflow.regenerate.generate_server"


def prompt_turns(messages) -> list[dict]:
    """A conversation's turns without its assistant turns (their other fields, a user's `name`,
    kept for the template)."""
    return [dict(m) for m in messages if m["role"] != "assistant"]


def tool_traffic(c: Conversation) -> bool:
    return bool(c.tools) or any(m["role"] == "tool" or "tool_calls" in m for m in c.messages)


TOOL_ROWS = (
    "a row with tool traffic is regenerated only with `data.regenerate.tool_parser` (vLLM's "
    "tool parser of the target's family, e.g. kimi_k2): without it the target's tool calls "
    "cannot be compared with the calls the row's tool results answer"
)


def answer_points(c: Conversation, tools: bool) -> list[tuple[list[dict], dict | None]]:
    """Where the target answers: (turns added before the reply, the dataset's assistant turn
    there or None). Without tool traffic, after each user turn (trailing other turns dropped);
    with it, wherever the dataset has an assistant turn after new user or tool turns, and
    after trailing user or tool turns."""
    points, turns = [], []
    for m in c.messages:
        if m["role"] == "assistant":
            if tools and turns:
                points.append((turns, m))
                turns = []
            continue
        turns.append(dict(m))
        if not tools and m["role"] == "user":
            points.append((turns, None))
            turns = []
    if tools and turns and turns[-1]["role"] in ("user", "tool"):
        points.append((turns, None))
    return points


def _call_key(call: dict) -> tuple:
    """A tool call as compared: its id (None when not given), name and arguments as JSON
    values (text or object alike)."""
    import json

    fn = call.get("function") or {}
    args = fn.get("arguments", "")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # compared as text
    return call.get("id"), fn.get("name"), json.dumps(args, sort_keys=True)


def same_calls(given: list[dict], made: list[dict]) -> bool:
    """Whether the target made exactly the dataset's calls, in order (ids compared where both
    have one)."""
    if len(given) != len(made):
        return False
    for a, b in zip(map(_call_key, given), map(_call_key, made)):
        if a[1:] != b[1:] or (a[0] is not None and b[0] is not None and a[0] != b[0]):
            return False
    return True


@dataclass(frozen=True)
class ReplyForm:
    """What a generated reply becomes (`data.regenerate.reasoning_parser`, `on_truncated`).

    `split(text) -> (reasoning or None, content or None)`: vLLM's reasoning parser of the
    target's family (`reasoning_parser`), so that a thinking-mode reply becomes
    `reasoning_content` + `content` again; None keeps the text as `content`. A reply cut at
    `max_new_tokens` is kept (`keep`) or ends its conversation before that turn (`drop`)."""

    split: Callable[[str], tuple[str | None, str | None]] | None = None
    on_truncated: str = "keep"
    # (messages, tools) -> token ids of the conversation as the template renders it, without a
    # generation prompt (`conversation_renderer`): with it, each reply whose generated ids
    # came back is checked to re-render to exactly the prompt plus those ids (`rerender_check`).
    rerender: Callable[..., list[int]] | None = None
    # content -> (content without its tool calls, OpenAI tool calls): vLLM's tool parser
    # (`tool_splitter`, data.regenerate.tool_parser); None: rows with tool traffic are rejects.
    calls: Callable[[str], tuple[str, list[dict]]] | None = None

    def message(self, text: str) -> dict:
        reasoning, content = (None, text) if self.split is None else self.split(text)
        out = {"role": "assistant", "content": content or ""}
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.calls is not None and out["content"]:
            rest, calls = self.calls(out["content"])
            if calls:
                out["content"], out["tool_calls"] = rest, calls
        return out


def vllm_reasoning_parser(name: str, tokenizer, key: str):
    """vLLM's reasoning parser `name` for `tokenizer`; a ValueError naming the config `key`
    that asked for it when this vLLM has none of that name."""
    from vllm.reasoning import ReasoningParserManager

    try:
        return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)
    except KeyError as e:
        raise ValueError(
            f"{key} is {name!r}, which this vLLM does not have; use one of vLLM's reasoning "
            "parser names (kimi_k2, deepseek_r1, qwen3, ...)"
        ) from e


def reasoning_splitter(name: str, tokenizer) -> Callable[[str], tuple[str | None, str | None]]:
    """vLLM's reasoning parser `name` (kimi_k2, deepseek_r1, qwen3, ...) over whole replies."""
    parser = vllm_reasoning_parser(name, tokenizer, "data.regenerate.reasoning_parser")
    end = parser.reasoning_end_str or ""

    def split(text: str) -> tuple[str | None, str | None]:
        reasoning, content = parser.extract_reasoning(text, None)
        # The parser strips whitespace at the end of the reasoning ("1 1 " -> "1 1"), which the
        # template would not render: the reply would not render back to its generated tokens.
        # The reasoning is kept as generated: the text before the content and the end marker.
        if reasoning is not None and (content is None or text.endswith(content)):
            head = text if content is None else text[: len(text) - len(content)]
            head = head[: -len(end)] if end and head.endswith(end) else head
            if head.strip() == reasoning.strip():
                reasoning = head
        return reasoning, content

    return split


def tool_splitter(name: str, tokenizer) -> Callable[[str], tuple[str, list[dict]]]:
    """vLLM's tool parser `name` (kimi_k2, deepseek_v3, hermes, ...) over a reply's content:
    (content without the calls, the calls as OpenAI `tool_calls`)."""
    from vllm.tool_parsers import ToolParserManager

    try:
        parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    except KeyError as e:
        raise ValueError(
            f"data.regenerate.tool_parser is {name!r}, which this vLLM does not have; use one "
            "of vLLM's tool parser names (kimi_k2, deepseek_v3, hermes, ...)"
        ) from e

    def split(content: str) -> tuple[str, list[dict]]:
        info = parser.extract_tool_calls(content, None)
        if not info.tools_called:
            return content, []
        calls = [
            {
                **({"id": c.id} if c.id else {}),
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in info.tool_calls
        ]
        return info.content or "", calls

    return split


def rerender_check(prompt, generated, rendered, finish_reason: str) -> int | None:
    """None when a written-out reply renders back to the tokens the target produced, else the
    first position (counted from the reply's first token) where it does not.

    `rendered`: the conversation up to and with the reply, as the template renders it (no
    generation prompt). A reply that ended itself must render to exactly `prompt` + `generated`
    (its end-of-turn token included); one cut at the budget (`length`) must render to them
    followed by whatever the template closes a turn with (`</think>`, `<|im_end|>`): those
    tokens were not generated, and a shard trains on them all the same."""
    expected = [int(t) for t in prompt] + [int(t) for t in generated]
    rendered = [int(t) for t in rendered]
    got = rendered if finish_reason != "length" else rendered[: len(expected)]
    if got == expected:
        return None
    first = next(
        (k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))
    )
    return first - len(prompt)


def regenerate_conversations(
    conversations: list[Conversation],
    generate,
    render,
    max_prompt_tokens: int,
    log=print,
    form: ReplyForm = ReplyForm(),
):
    """(rows, bad): `rows` are {"id", "messages"} with every user turn answered by `generate`.

    render(messages) -> prompt token ids (chat template plus generation prompt; the history as
    the template renders it: a reasoning template empties earlier turns' reasoning);
    generate(list of prompt token-id lists) -> per prompt, in order, the reply text or (text,
    finish reason). `form` makes each reply a message (module ReplyForm).
    A conversation stops (its later turns dropped) once its next prompt would be at least
    `max_prompt_tokens` long: sharding truncates there anyway.
    """
    tool_rows = [c for c in conversations if tool_traffic(c) and form.calls is None]
    conversations = [c for c in conversations if not tool_traffic(c) or form.calls is not None]
    pending = [answer_points(c, tool_traffic(c)) for c in conversations]
    expected: list[dict | None] = [None] * len(conversations)  # the turn each reply replaces
    diverged = 0  # tool rows ended where the target's calls were not the dataset's
    done: list[list[dict]] = [[] for _ in conversations]
    answered = [0] * len(conversations)
    stopped_early = 0
    truncated = dropped = 0
    rerendered = {"exact": 0, "cut": 0, "mismatched": 0}  # form.rerender: replies checked
    cut_first = [False] * len(conversations)  # the first reply was cut and dropped
    rounds = 0
    while True:
        batch = []
        for i, c in enumerate(conversations):
            if not pending[i]:
                continue  # nothing left to answer (trailing non-user turns are dropped)
            moved, expected[i] = pending[i].pop(0)
            ids = render(done[i] + moved, c.tools) if c.tools else render(done[i] + moved)
            if len(ids) >= max_prompt_tokens:
                stopped_early += bool(pending[i]) or answered[i] > 0
                pending[i] = []
                continue
            done[i] += moved
            batch.append((i, ids))
        if not batch:
            break
        t0 = time.time()
        replies = generate([ids for _, ids in batch])
        if len(replies) != len(batch):
            raise RuntimeError(f"generate returned {len(replies)} replies for {len(batch)} prompts")
        for (i, prompt), reply in zip(batch, replies):
            text, reason = (reply, "stop") if isinstance(reply, str) else tuple(reply)[:2]
            generated = None if isinstance(reply, str) or len(reply) < 3 else reply[2]
            if reason == "length":
                truncated += 1
                if form.on_truncated == "drop":  # this turn and the rest of the conversation
                    dropped += 1
                    cut_first[i] = answered[i] == 0
                    while done[i] and done[i][-1]["role"] != "assistant":
                        done[i].pop()
                    pending[i] = []
                    continue
            done[i].append(form.message(text))
            answered[i] += 1
            c = conversations[i]
            if pending[i] and tool_traffic(c):
                given = (expected[i] or {}).get("tool_calls") or []
                if not same_calls(given, done[i][-1].get("tool_calls") or []):
                    diverged += 1
                    log(
                        f"{c.sample_id}, reply {answered[i]}: the target's tool calls are not "
                        f"the dataset's ({len(given)} given), so the row's later tool results "
                        "do not answer it: the row ends with this reply"
                    )
                    pending[i] = []
            if form.rerender is not None and generated is not None:
                full = form.rerender(done[i], c.tools) if c.tools else form.rerender(done[i])
                at = rerender_check(prompt, generated, full, reason)
                if at is None:
                    rerendered["cut" if reason == "length" else "exact"] += 1
                else:
                    rerendered["mismatched"] += 1
                    log(
                        f"{conversations[i].sample_id}, reply {answered[i]}: the written-out "
                        f"reply does not render back to the generated tokens (first "
                        f"difference at its token {at}; finish reason {reason})"
                    )
        rounds += 1
        log(f"round {rounds}: {len(batch)} prompts answered in {time.time() - t0:.1f}s")
    rows, bad = [], [BadRow(c.source_file, c.source_row, TOOL_ROWS, c.sample_id) for c in tool_rows]
    for c, msgs, n, cut in zip(conversations, done, answered, cut_first):
        if n == 0:
            reason = (
                "the first reply was cut at data.regenerate.max_new_tokens, and "
                "`data.regenerate.on_truncated: drop` drops it"
                if cut
                else f"the first prompt is at least {max_prompt_tokens} tokens long: "
                "nothing left for the target to answer"
            )
            bad.append(BadRow(c.source_file, c.source_row, reason, c.sample_id))
            continue
        rows.append(
            {"id": c.sample_id, "messages": msgs, **({"tools": list(c.tools)} if c.tools else {})}
        )
    bad.sort(key=lambda b: b.source_row)
    stats = {
        "conversations": len(rows),
        "rounds": rounds,
        "replies": sum(answered),
        "stopped_early": stopped_early,
        "truncated": truncated,
        "truncated_dropped": dropped,
        "tool_calls_diverged": diverged,
        "rejected": len(bad),
    }
    if form.rerender is not None:
        stats["rerendered"] = rerendered
    return rows, bad, stats


def chat_renderer(tokenizer, chat_template_kwargs: dict | None = None):
    """(messages, tools) -> prompt token ids: the chat template with `data.chat_template_kwargs`,
    the row's tools and the generation prompt."""
    return _renderer(tokenizer, chat_template_kwargs, True)


def conversation_renderer(tokenizer, chat_template_kwargs: dict | None = None):
    """(messages, tools) -> token ids of the whole conversation (no generation prompt), with
    `data.chat_template_kwargs`: how the shard renders a regenerated reply."""
    return _renderer(tokenizer, chat_template_kwargs, False)


def _renderer(tokenizer, chat_template_kwargs, add_generation_prompt: bool):
    kwargs = dict(chat_template_kwargs or {})

    def render(messages, tools=()):
        out = tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
            **kwargs,
        )
        return list(out["input_ids"])

    return render


def start_generate_engine(settings: EngineSettings):
    """The engine regeneration answers with: no capture hooks, prefix caching on (a round's
    prompts extend the previous round's), CUDA graphs on GPUs (they speed up decoding; the CPU
    backend runs eager). A job's own generator and the shared engine server both build it here.

    `settings.max_num_seqs`: vLLM's cap on sequences decoded together (None: vLLM's default);
    one `generate` call hands vLLM a whole round, so on a CPU a larger cap means fewer, fuller
    decode steps. `settings.mla=False` builds the DeepSeek attention as `DeepseekV2Attention`
    (the latent `kv_a_proj_with_mqa` -> `kv_a_layernorm` -> `kv_b_proj` up-projection run at
    every step and full per-head K/V cached) instead of `DeepseekV2MLAAttention` (the latent
    cached, `kv_b_proj` absorbed into the query/output): the same weights and, on paper, the
    same function, decoded much faster by vLLM's CPU backend (docs/measurements/)."""
    from eagleflow.engine.builder import build_engine

    return build_engine(settings, eager=settings.device == "cpu")


def generate_replies(
    llm, prompts, max_new_tokens: int, keep_special_tokens: bool = False
) -> list[tuple]:
    """One batched greedy `LLM.generate` over prompt id lists: (text, finish reason, generated
    token count) per prompt, in order. Stops at the tokenizer's end-of-turn token or after
    `max_new_tokens`. `keep_special_tokens`: the text keeps markers such as `</think>` (a
    reasoning parser splits on them), and each reply also carries its generated token ids,
    so that the written-out reply can be checked to render back to them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Markers kept as written: no spaces around them (vLLM inserts some for slow tokenizers
    # such as Kimi's by default), or the reply would not render back to its tokens.
    keep = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    params = SamplingParams(
        temperature=0.0, max_tokens=max_new_tokens, **(keep if keep_special_tokens else {})
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts],
        params,
        use_tqdm=False,
    )
    return [
        (o.outputs[0].text, o.outputs[0].finish_reason, len(o.outputs[0].token_ids))
        + ((list(o.outputs[0].token_ids),) if keep_special_tokens else ())
        for o in outputs
    ]


def own_engine() -> dict:
    """The engine record of a job that loaded its engine itself."""
    return {"server": False, "loaded_here": True, "server_pid": None}


@dataclass
class Generator:
    """A job's replies: called with prompt id lists, it returns (text, finish reason) per reply,
    in order, from
    `replies_of` (prompt id lists -> (text, finish reason, generated tokens) per prompt), and
    counts the finish reasons, the generated tokens and the seconds spent waiting for them.
    `engine` is the job's engine record {server, loaded_here, server_pid}."""

    replies_of: Callable[[list[list[int]]], list[tuple[str, str, int]]]
    engine: dict = field(default_factory=own_engine)
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0})
    generated_tokens: int = 0
    generate_s: float = 0.0

    def __call__(self, prompts) -> list[tuple]:
        """(text, finish reason) per reply, and its generated ids where they came back."""
        t0 = time.time()
        replies = self.replies_of(prompts)
        for _, reason, n, *_ in replies:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.generated_tokens += n
        self.generate_s += time.time() - t0
        return [(text, reason, *ids) for text, reason, _, *ids in replies]


def vllm_generator(
    settings: EngineSettings, max_new_tokens: int, keep_special_tokens: bool = False
) -> Generator:
    """Greedy replies through an engine of this job's own (`start_generate_engine`)."""
    llm = start_generate_engine(settings)
    return Generator(
        lambda prompts: generate_replies(llm, prompts, max_new_tokens, keep_special_tokens)
    )


def served_generator(
    client: EngineClient, max_new_tokens: int, keep_special_tokens: bool = False
) -> Generator:
    """Greedy replies from the shared generate engine server `client` is connected to: the
    same `generate_replies` call, made in the server (eagleflow.regenerate.generate_server)."""
    return Generator(
        lambda prompts: client.generate(prompts, max_new_tokens, keep_special_tokens),
        engine=client.engine,
    )


def generator_for(
    settings: EngineSettings,
    max_new_tokens: int,
    server: ServerSpec | None,
    stack: ExitStack,
    keep_special_tokens: bool = False,
) -> Callable[[], Generator]:
    """What a regenerate_shard job hands `regenerate_source_shard`: makes its generator when the
    shard has chunks to answer. Through the shared server of spec `server` (started if none
    runs; the connection stays open until `stack` closes, so the server's idle clock starts when
    the job ends), or an engine of the job's own when `server` is None."""

    def make() -> Generator:
        if server is None:
            return vllm_generator(settings, max_new_tokens, keep_special_tokens)
        client = stack.enter_context(EngineClient(server, GENERATE_SERVER))
        return served_generator(client, max_new_tokens, keep_special_tokens)

    return make
