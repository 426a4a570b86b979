"""Conversations turn by turn, as MT-Bench runs them, for every measured path.

A prompt is its messages up to the first user turn plus later user turns (`followups`). Turn 1
is generated from the messages; turn j from the messages, the target's own reply to each
earlier turn (its generated tokens decoded, special tokens skipped) and user turn j. The
counters of every turn add up to the prompt's (one record per prompt), so a two-turn prompt
weighs as the benchmark weighs it.

`generate(token_ids) -> (output token ids, counters)` is the path's: vLLM's engine in
`eagleflow.evaluate.spec_decode_check`, or the reference loop in `eagleflow.evaluate.acceptance`.
Counters are vLLM's spec-decode counters of that one generation: `num_drafts`,
`num_draft_tokens`, `num_accepted_tokens`, `num_accepted_tokens_per_pos`.

A turn whose prompt is over `max_prompt_tokens` (the engine's length less the tokens
generated) is not generated, and it and the conversation's later turns are counted as
`turns_skipped`: the prompt is never cut, which would change the benchmark.

**Modes and tools.** An item carries the chat-template keyword arguments of its mode
(`evaluate.modes`, e.g. `{thinking: false}`) and the row's `tools`; every turn's prompt is
rendered with them, so one engine serves every mode: a mode changes the prompt's tokens only.

**Reasoning and answer** (`ReplyParts`, from vLLM's reasoning parser of the target's family):
when a turn's prompt leaves the reply inside a reasoning block (the parser's
`is_reasoning_end` is false on it: Kimi-K2.5's thinking mode opens `<think>` in its generation
prompt), the turn is generated in two requests, the first stopped at the parser's
reasoning-end token (`</think>`, or a tool-call section), the second continuing from the prompt
and those tokens with what is left of the budget. Greedy, the tokens are the ones one request
gives; the counters of the first request are the reasoning's, those of the second the answer's
(whose first token comes from a prefill, as a reply's first token always does). A turn whose
prompt has reasoning ended (instant mode) is all answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PARTS = ("reasoning", "answer")


@dataclass(frozen=True)
class ReplyParts:
    """Where a reply's reasoning ends: `end_ids`, the tokens that close it; `opens(prompt ids)`,
    whether a reply to that prompt starts inside reasoning."""

    end_ids: frozenset[int]
    opens: Callable[[list[int]], bool]


def reply_parts(parser_name: str | None, tokenizer) -> ReplyParts | None:
    """`ReplyParts` from vLLM's reasoning parser `parser_name` (kimi_k2, deepseek_r1, qwen3,
    ...); None without one (the reply is not split). ValueError names an unknown parser or one
    whose end-of-reasoning token the tokenizer lacks."""
    if not parser_name:
        return None
    from eagleflow.regenerate.replies import vllm_reasoning_parser

    parser = vllm_reasoning_parser(parser_name, tokenizer, "evaluate.reasoning_parser")
    ends = getattr(parser, "reasoning_end_token_ids", None)
    if not ends and getattr(parser, "end_token_id", None) is not None:
        ends = {parser.end_token_id}
    if not ends:
        raise ValueError(
            f"vLLM's reasoning parser {parser_name!r} names no end-of-reasoning token in this "
            "tokenizer; per-part figures need one"
        )
    return ReplyParts(frozenset(int(t) for t in ends), lambda ids: not parser.is_reasoning_end(ids))


def zero_counters(k: int) -> dict:
    return {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "num_accepted_tokens_per_pos": [0] * k,
    }


def add_counters(total: dict, more: dict) -> None:
    for key, value in more.items():
        if isinstance(value, list):
            have = total.setdefault(key, [0] * len(value))
            if len(have) < len(value):
                have += [0] * (len(value) - len(have))
            for i, v in enumerate(value):
                have[i] += int(v)
        elif key in total or key.startswith("num_"):
            total[key] = total.get(key, 0) + int(value)


def run_conversation(
    item: dict,
    render: Callable[..., list[int]],
    generate: Callable[..., tuple[list[int], dict]],
    decode: Callable[[list[int]], str],
    k: int,
    max_prompt_tokens: int | None = None,
    parts: ReplyParts | None = None,
    max_tokens: int | None = None,
) -> dict:
    """One prompt (`item`: `messages`, `followups`, optional `tools` and
    `chat_template_kwargs`) through every turn. `render(messages, tools, kwargs)` -> prompt
    ids; `generate(ids)` -> (output ids, counters), also called as `generate(ids, stop=...)`
    and `generate(ids, max_tokens=...)` to split a reply by `parts` (module docstring), which
    needs the turn's budget `max_tokens`. Returns the prompt's record: `counters` (summed over
    turns), `turns` (each turn's output ids), `replies` (their text), `prompt_tokens` (each
    generated turn's prompt length), `turns_skipped`, and with `parts` the counters of the
    reasoning and of the answer (`parts`)."""
    if parts is not None and max_tokens is None:
        raise ValueError("splitting replies into reasoning and answer needs the turn's max_tokens")
    messages = [dict(m) for m in item["messages"]]
    followups = list(item.get("followups") or [])
    tools, kwargs = tuple(item.get("tools") or ()), item.get("chat_template_kwargs")
    counters = zero_counters(k)
    by_part = {p: zero_counters(k) for p in PARTS}
    turns, replies, lengths = [], [], []
    for j in range(1 + len(followups)):
        if j:
            messages += [
                {"role": "assistant", "content": replies[-1]},
                {"role": "user", "content": followups[j - 1]},
            ]
        ids = list(render(messages, tools, kwargs))
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            break
        if parts is not None and parts.opens(ids):
            out, c = generate(ids, stop=parts.end_ids, max_tokens=max_tokens)
            add_counters(by_part["reasoning"], c)
            left = max_tokens - len(out)
            if out and out[-1] in parts.end_ids and left > 0:
                more, c_answer = generate(ids + list(out), max_tokens=left)
                add_counters(by_part["answer"], c_answer)
                out = list(out) + list(more)
                c = dict(c)
                add_counters(c, c_answer)
        else:
            out, c = generate(ids)
            add_counters(by_part["answer"], c)
        add_counters(counters, c)
        turns.append(list(out))
        replies.append(decode(out).strip())
        lengths.append(len(ids))
    record = {
        "counters": counters,
        "turns": turns,
        "replies": replies,
        "prompt_tokens": lengths,
        "turns_skipped": 1 + len(followups) - len(turns),
    }
    if parts is not None:
        record["parts"] = by_part
    return record


def chat_renderer(tokenizer, chat_template_kwargs: dict | None = None):
    """(messages, tools, kwargs) -> token ids: the target's chat template with the generation
    prompt, the row's tools and `kwargs` (a mode's) over `chat_template_kwargs`."""
    base = dict(chat_template_kwargs or {})

    def render(messages: list[dict], tools=(), kwargs: dict | None = None) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                messages,
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **{**base, **(kwargs or {})},
            )["input_ids"]
        )

    return render
