"""Held-out evaluation prompts, chosen by content hash (never trained on).

A conversation is held out when sha256(sample_id) mod `modulus` == 0, where the sample id is
already a hash of the conversation's content (`conversations.content_id`): the split does not
depend on file order, survives appending or reordering samples, and is the same for every
consumer (target training, sharding/extraction, draft training, evaluation).

A conversation that a reasoning template cuts into several samples (`<id>#turn<k>`,
eagleflow.data.templating) is decided by its conversation id, so all its samples fall on one
side.
"""

from __future__ import annotations

import hashlib
import re

HELDOUT_MODULUS = 20  # 1 in 20 conversations (5%)
_TURN = re.compile(r"^(.*)#turn[0-9]+$", re.DOTALL)


def conversation_of(sample_id: str) -> str:
    """The conversation id of a sample id (itself, for a conversation that is one sample)."""
    m = _TURN.match(sample_id)
    return m.group(1) if m else sample_id


def is_heldout(sample_id: str, modulus: int = HELDOUT_MODULUS) -> bool:
    key = conversation_of(sample_id)
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % modulus == 0


def excluder(modulus: int = HELDOUT_MODULUS):
    """sample_id -> True when held out: what training (target, draft vocabulary, draft) skips."""
    return lambda sample_id: is_heldout(sample_id, modulus)


def split(conversations, modulus: int = HELDOUT_MODULUS):
    """(train, heldout) lists of `Conversation`s, each in dataset order."""
    train, held = [], []
    for c in conversations:
        (held if is_heldout(c.sample_id, modulus) else train).append(c)
    return train, held


def heldout_prompts(conversations, modulus: int = HELDOUT_MODULUS, limit: int | None = None):
    """One prompt per held-out conversation: its messages up to and including the first user
    turn, the row's `tools` (the template renders them into the prompt), plus the dataset's
    reply to it (None for prompt-only rows)."""
    out = []
    for c in split(conversations, modulus)[1]:
        msgs = list(c.messages)
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        reply = msgs[first_user + 1] if first_user + 1 < len(msgs) else None
        out.append(
            {
                "sample_id": c.sample_id,
                "messages": msgs[: first_user + 1],
                "tools": list(c.tools),
                "reference": reply["content"] if reply and reply["role"] == "assistant" else None,
            }
        )
        if limit is not None and len(out) >= limit:
            break
    return out
