"""Chat template -> token ids and assistant-only loss masks, with transformers' own machinery.

Every message field the dataset carries (`reasoning_content`, `tool_calls`, `tool_call_id`,
`name`, the `tool` role) and the row's `tools` list reach the template, with
`data.chat_template_kwargs`; what the template does with them is its own business.

Masks come from rendering growing prefixes of the conversation: the tokens an assistant turn
adds beyond the generation prompt before it are the ones it is trained on (templates that mark
assistant text with `{% generation %}` give the same mask, and theirs is used when the whole
conversation is one sample, as before).

**Samples.** Reasoning templates render history differently from the turn being generated
(Kimi-K2.5 empties earlier turns' `<think>`, Qwen3 drops reasoning before the last user turn).
A conversation is then cut, by rendering alone, into several samples: a sample grows turn by
turn while each rendering extends the previous one; when the next turn's context (the
generation prompt before it) no longer extends the sample, the sample ends and the next one
starts from that context, which is exactly what the target reads when it writes that turn in
service. A template that renders every prefix consistently gives one sample, as before. A
turn whose own rendering does not extend its generation prompt cannot be masked: the row is a
named reject (`TemplateMismatch`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

# Fields a message may carry besides role and content (eagleflow.data.conversations); the
# row-level `tools` list is checked like them.
MESSAGE_FIELDS = ("reasoning_content", "tool_calls", "tool_call_id", "name")
REASONING_SAMPLES = ("per_turn", "last_turn")
TURN_SEP = "#turn"  # sample id of a conversation's k-th sample: <conversation id>#turn<k>


@dataclass(frozen=True)
class Tokenized:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on assistant tokens


@dataclass(frozen=True)
class TemplateSettings:
    """How the chat template is applied (`data.chat_template_kwargs`, `data.reasoning_samples`)."""

    kwargs: dict = field(default_factory=dict)  # passed to apply_chat_template
    reasoning_samples: str = "per_turn"  # per_turn | last_turn: which samples are kept

    def __post_init__(self):
        if self.reasoning_samples not in REASONING_SAMPLES:
            raise ValueError(
                f"data.reasoning_samples is {self.reasoning_samples!r}; use one of "
                f"{', '.join(REASONING_SAMPLES)}"
            )
        if not isinstance(self.kwargs, dict):
            raise ValueError("data.chat_template_kwargs must be a mapping (e.g. {thinking: true})")

    def record(self) -> dict:
        """What enters the tokenizer digest: nothing at the defaults (the ids of data made
        before these keys existed stay as they were)."""
        out = {}
        if self.kwargs:
            out["chat_template_kwargs"] = self.kwargs
        if self.reasoning_samples != "per_turn":
            out["reasoning_samples"] = self.reasoning_samples
        return out


DEFAULT = TemplateSettings()


class TemplateMismatch(ValueError):
    """The template renders an assistant turn so that its tokens cannot be told apart."""


@dataclass(frozen=True)
class Rendered:
    """One conversation through the template: its samples (suffix "" when it is one sample,
    else TURN_SEP + k) and what the template did with the fields the row carries."""

    samples: list[tuple[str, Tokenized]]
    fields: tuple[str, ...]  # optional fields the row carries (MESSAGE_FIELDS, "tools")
    not_rendered: tuple[str, ...]  # those the template renders nowhere
    reasoning_tokens: int  # tokens of reasoning text found inside a sample's loss mask
    dropped_samples: int  # samples whose truncation left no loss token


def has_generation_markers(tokenizer) -> bool:
    return "{% generation %}" in (tokenizer.chat_template or "") or "{%- generation %}" in (
        tokenizer.chat_template or ""
    )


def _apply(tokenizer, messages, tools, settings, tokenize, add_generation_prompt=False):
    out = tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        tokenize=tokenize,
        return_dict=tokenize,
        add_generation_prompt=add_generation_prompt,
        **settings.kwargs,
    )
    return list(out["input_ids"]) if tokenize else out


def tokenize_conversation(
    tokenizer, messages, max_length: int, settings: TemplateSettings = DEFAULT, tools=()
) -> Tokenized:
    """One conversation as one sample (target training, tests): the template must render it
    consistently; a reasoning template's several samples are `render_conversation`'s."""
    messages = list(messages)
    samples = _samples(tokenizer, messages, tools, settings)
    if not samples:  # nothing to train on (no assistant turn): the rendering, all unmasked
        ids = np.asarray(_apply(tokenizer, messages, tools, settings, True), dtype=np.int64)
        samples = [Tokenized(ids, np.zeros(len(ids), dtype=np.uint8))]
    if len(samples) != 1:
        raise TemplateMismatch(
            f"the chat template renders this conversation as {len(samples)} samples (it "
            "renders history differently from the last turn); use render_conversation"
        )
    return _truncate(samples[0], max_length)


def render_conversation(
    tokenizer, messages, max_length: int, settings: TemplateSettings = DEFAULT, tools=()
) -> Rendered:
    """Samples of one conversation, truncated to `max_length`, with the fields the template
    ignores. Raises TemplateMismatch, or whatever the template raises, for a row it cannot
    render."""
    messages = list(messages)
    samples = _samples(tokenizer, messages, tools, settings)
    if settings.reasoning_samples == "last_turn":
        samples = samples[-1:]
    kept = [_truncate(s, max_length) for s in samples]
    named = [("" if len(kept) == 1 else f"{TURN_SEP}{k + 1}", t) for k, t in enumerate(kept)]
    good = [(sfx, t) for sfx, t in named if t.loss_mask.any()]
    present = _present_fields(messages, tools)
    ignored = tuple(
        f for f in present if not _renders_field(tokenizer, messages, tools, settings, f)
    )
    return Rendered(
        good,
        present,
        ignored,
        _reasoning_tokens(tokenizer, messages, [t for _, t in good]),
        len(named) - len(good),
    )


def _truncate(t: Tokenized, max_length: int) -> Tokenized:
    return Tokenized(t.input_ids[:max_length], t.loss_mask[:max_length])


def _samples(tokenizer, messages, tools, settings) -> list[Tokenized]:
    """The conversation cut into samples by rendering (module docstring)."""
    if has_generation_markers(tokenizer) and _renders_consistently(
        tokenizer, messages, tools, settings
    ):  # one sample, masked by the template's own markers (one tokenized call)
        out = tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **settings.kwargs,
        )
        return [
            Tokenized(
                np.asarray(out["input_ids"], dtype=np.int64),
                np.asarray(out["assistant_masks"], dtype=np.uint8),
            )
        ]

    def render(n, gen=False):
        return _apply(tokenizer, messages[:n], tools, settings, True, gen)

    done, ids, mask = [], [], []

    def close():
        if any(mask):
            done.append(Tokenized(np.asarray(ids, np.int64), np.asarray(mask, np.uint8)))

    for i, message in enumerate(messages):
        assistant = message["role"] == "assistant"
        if assistant and i > 0:
            prompt = render(i, gen=True)
            if prompt[: len(ids)] != ids:  # the context of this turn is not the sample's
                close()
                ids, mask = [], []
            mask += [0] * (len(prompt) - len(ids))
            ids = prompt
        full = render(i + 1)
        if full[: len(ids)] != ids:
            if assistant:
                raise TemplateMismatch(
                    f"the chat template renders the context of message {i} (assistant) "
                    "differently once the message follows it, so its tokens cannot be told "
                    "from the context's"
                )
            close()
            ids, mask = [], []
        mask += [int(assistant)] * (len(full) - len(ids))
        ids = full
    close()
    return done


def _renders_consistently(tokenizer, messages, tools, settings) -> bool:
    """Whether every rendering of a growing prefix (and each assistant turn's generation
    prompt) extends the one before, as text: then the conversation is one sample."""
    text = ""
    for i, message in enumerate(messages):
        steps = [(i, True)] if message["role"] == "assistant" and i > 0 else []
        for n, gen in [*steps, (i + 1, False)]:
            nxt = _apply(tokenizer, messages[:n], tools, settings, False, gen)
            if not nxt.startswith(text):
                return False
            text = nxt
    return True


def _present_fields(messages, tools) -> tuple[str, ...]:
    present = [f for f in MESSAGE_FIELDS if any(f in m for m in messages)]
    return (*present, "tools") if tools else tuple(present)


def _without(messages, tools, name):
    if name == "tools":
        return messages, ()
    return [{k: v for k, v in m.items() if k != name} for m in messages], tools


def _renders_field(tokenizer, messages, tools, settings, name) -> bool:
    """Whether the template renders `name`: the rendering ending on a message that carries it
    (the turn being written, where reasoning templates keep reasoning), or the whole
    conversation (where that message is history), differs without it. Two renderings per
    place, not one per prefix: agent traces are long."""
    bare, bare_tools = _without(messages, tools, name)
    ends = [] if name == "tools" else [i + 1 for i, m in enumerate(messages) if name in m]
    for n in dict.fromkeys([*ends, len(messages)]):
        with_it = _apply(tokenizer, messages[:n], tools, settings, False)
        if with_it != _apply(tokenizer, bare[:n], bare_tools, settings, False):
            return True
    return False


def _reasoning_tokens(tokenizer, messages, samples: list[Tokenized]) -> int:
    """Tokens of the assistant turns' reasoning text found inside some sample's loss mask."""
    texts = [m["reasoning_content"] for m in messages if m.get("reasoning_content")]
    if not texts:
        return 0
    trained = [tokenizer.decode(t.input_ids[t.loss_mask.astype(bool)]) for t in samples]
    return sum(
        len(tokenizer.encode(r, add_special_tokens=False))
        for r in texts
        if any(r in text for text in trained)
    )


def tokenizer_digest(tokenizer, settings: TemplateSettings = DEFAULT) -> str:
    """What makes tokens from text: the vocabulary/merges (tokenizer.json), the template, and
    how it is applied when that is not the default."""
    backend = (
        tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else ""
    )
    record = {"tokenizer": backend, "chat_template": tokenizer.chat_template or ""}
    record.update(settings.record())
    blob = json.dumps(record, sort_keys=bool(settings.record()))
    return hashlib.sha256(blob.encode()).hexdigest()
