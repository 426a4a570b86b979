"""Held-out evaluation prompts, chosen by content hash (never trained on).

A conversation is held out when sha256(sample_id) mod `modulus` == 0, where the sample id is
already a hash of the conversation's content (`conversations.content_id`): the split does not
depend on file order, survives appending or reordering samples, and is the same for every
consumer (target training, sharding/extraction, draft training, evaluation).
"""

from __future__ import annotations

import hashlib

HELDOUT_MODULUS = 20  # 1 in 20 conversations (5%)


def is_heldout(sample_id: str, modulus: int = HELDOUT_MODULUS) -> bool:
    return int(hashlib.sha256(sample_id.encode()).hexdigest(), 16) % modulus == 0


def split(conversations, modulus: int = HELDOUT_MODULUS):
    """(train, heldout) lists of `Conversation`s, each in dataset order."""
    train, held = [], []
    for c in conversations:
        (held if is_heldout(c.sample_id, modulus) else train).append(c)
    return train, held


def heldout_prompts(conversations, modulus: int = HELDOUT_MODULUS, limit: int | None = None):
    """One prompt per held-out conversation: its messages up to (not including) the first
    assistant turn, plus that turn's reference text."""
    out = []
    for c in split(conversations, modulus)[1]:
        msgs = list(c.messages)
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        out.append({"sample_id": c.sample_id, "messages": msgs[:first],
                    "reference": msgs[first]["content"]})
        if limit is not None and len(out) >= limit:
            break
    return out
