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
"""

from __future__ import annotations

from collections.abc import Callable


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
    render: Callable[[list[dict]], list[int]],
    generate: Callable[[list[int]], tuple[list[int], dict]],
    decode: Callable[[list[int]], str],
    k: int,
    max_prompt_tokens: int | None = None,
) -> dict:
    """One prompt (`item`: `messages`, `followups`) through every turn. Returns its record:
    `counters` (summed over turns), `turns` (each turn's output ids), `replies` (their text),
    `prompt_tokens` (each generated turn's prompt length) and `turns_skipped`."""
    messages = [dict(m) for m in item["messages"]]
    followups = list(item.get("followups") or [])
    counters = zero_counters(k)
    turns, replies, lengths = [], [], []
    for j in range(1 + len(followups)):
        if j:
            messages += [
                {"role": "assistant", "content": replies[-1]},
                {"role": "user", "content": followups[j - 1]},
            ]
        ids = list(render(messages))
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            break
        out, c = generate(ids)
        add_counters(counters, c)
        turns.append(list(out))
        replies.append(decode(out).strip())
        lengths.append(len(ids))
    return {
        "counters": counters,
        "turns": turns,
        "replies": replies,
        "prompt_tokens": lengths,
        "turns_skipped": 1 + len(followups) - len(turns),
    }


def chat_renderer(tokenizer, chat_template_kwargs: dict | None = None):
    """messages -> token ids: the target's chat template with the generation prompt."""
    kwargs = dict(chat_template_kwargs or {})

    def render(messages: list[dict]) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
            )["input_ids"]
        )

    return render
