"""Chat template -> token ids and assistant-only loss masks, with transformers' own machinery.

Templates that mark assistant text with `{% generation %}` get their mask from
`apply_chat_template(return_assistant_tokens_mask=True)`. Templates without the marker
(most released ones, Kimi's and DeepSeek's included) get it by rendering growing prefixes
of the conversation: the tokens an assistant turn adds are the ones it is trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tokenized:
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on assistant tokens


def has_generation_markers(tokenizer) -> bool:
    return "{% generation %}" in (tokenizer.chat_template or "") or "{%- generation %}" in (
        tokenizer.chat_template or ""
    )


def tokenize_conversation(tokenizer, messages, max_length: int) -> Tokenized:
    messages = list(messages)
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
    else:
        ids, mask = _prefix_diff_mask(tokenizer, messages)
    return Tokenized(ids[:max_length], mask[:max_length])


def _render(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"])


def _extend(ids: list[int], full: list[int]) -> list[int]:
    if full[: len(ids)] != ids:
        raise ValueError(
            "the chat template renders a conversation prefix differently once more turns "
            "follow, so assistant masks cannot be taken from prefixes; use a template with "
            "{% generation %} markers"
        )
    return full[len(ids) :]


def _prefix_diff_mask(tokenizer, messages):
    """Mask = tokens an assistant turn adds beyond the generation prompt before it (the
    assistant header stays unmasked, as with {% generation %} markers)."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and i > 0:
            prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
            mask += [0] * len(_extend(ids, prompt))
            ids = prompt
        full = _render(tokenizer, messages[: i + 1])
        mask += [1 if message["role"] == "assistant" else 0] * len(_extend(ids, full))
        ids = full
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def tokenizer_digest(tokenizer) -> str:
    """What makes tokens from text: the vocabulary/merges (tokenizer.json) and the template."""
    backend = (
        tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else ""
    )
    blob = json.dumps({"tokenizer": backend, "chat_template": tokenizer.chat_template or ""})
    return hashlib.sha256(blob.encode()).hexdigest()
