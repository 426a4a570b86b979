"""Real chat for the embedded default: `chitchat-dataset` (PyPI, MIT) as user/assistant turns.

The package ships `chitchat_dataset/dataset.json`: 7,168 human open-domain conversations,
keyed by a conversation id. A conversation's `messages` is a list of groups; a group is a list
of consecutive utterances (`text`, `timestamp`, `sender`) by one anonymous sender id. It is read
from the installed package (`importlib.resources`), never from the network.

The conversion (`to_turns`):
- utterances are stripped and empty ones dropped; consecutive utterances of one sender, within
  a group or across groups, become one turn, joined by newlines;
- the senders carry no roles, so the conversation's first speaker is the user and the other one
  the assistant; a conversation therefore never starts on the assistant side;
- conversations with a single speaker (3,150 of them: nobody answered) have no reply and are
  dropped, as are any with more than two speakers (none in 0.9.0).

The window (`window`): most conversations open with "hello?" / "hi!" exchanges, and a held-out
prompt is a conversation's first user turn (`eagleflow.data.heldout`), so a window starts at
the first user turn of at least `min_prompt_words` words and keeps at most `max_messages`
turns, ending on an assistant turn. Greetings would make most prompts alike; the window makes
the prompts, and so the target's replies, differ. A conversation whose window holds a turn of
more than `MAX_TURN_CHARS` characters is dropped: a prompt of 512 tokens (`data.max_length`)
leaves the target nothing to answer.
"""

from __future__ import annotations

import json
import random
from importlib import resources

PACKAGE = "chitchat_dataset"
MIN_PROMPT_WORDS = 8
MAX_TURN_CHARS = 600


def load_raw() -> dict:
    """The package's dataset.json: {conversation id: {"messages": [[utterance, ...], ...], ...}}."""
    return json.loads((resources.files(PACKAGE) / "dataset.json").read_text(encoding="utf-8"))


def to_turns(conversation: dict) -> list[dict] | None:
    """Alternating user/assistant `messages` of one conversation (first speaker = user), or
    None when it has no reply (one speaker) or more than two speakers."""
    turns: list[tuple[str, list[str]]] = []  # (sender, texts)
    for group in conversation.get("messages") or []:
        for u in group:
            text = (u.get("text") or "").strip()
            if not text:
                continue
            if turns and turns[-1][0] == u["sender"]:
                turns[-1][1].append(text)
            else:
                turns.append((u["sender"], [text]))
    senders = list(dict.fromkeys(s for s, _ in turns))
    if len(senders) != 2:
        return None
    role = {senders[0]: "user", senders[1]: "assistant"}
    return [{"role": role[s], "content": "\n".join(texts)} for s, texts in turns]


def window(
    messages: list[dict], max_messages: int, min_prompt_words: int = MIN_PROMPT_WORDS
) -> list[dict] | None:
    """At most `max_messages` turns from the first user turn of `min_prompt_words` or more
    words, ending on an assistant turn; None when no such user turn has a reply."""
    for i, m in enumerate(messages[:-1]):
        if m["role"] == "user" and len(m["content"].split()) >= min_prompt_words:
            out = messages[i : i + max_messages]
            if out[-1]["role"] == "user":
                out = out[:-1]
            return out
    return None


def conversations(
    n: int, seed: int = 0, max_messages: int = 4, raw: dict | None = None
) -> list[dict]:
    """`n` converted conversations (all there are when fewer qualify), a seeded sample in
    the dataset's order, as rows {"id", "corpus", "messages"} for the bundled dataset file."""
    raw = load_raw() if raw is None else raw
    rows = []
    for key, conv in raw.items():
        turns = to_turns(conv)
        msgs = window(turns, max_messages) if turns else None
        if msgs and max(len(m["content"]) for m in msgs) <= MAX_TURN_CHARS:
            rows.append({"id": f"chitchat-{key}", "corpus": "chitchat", "messages": msgs})
    keep = sorted(random.Random(seed).sample(range(len(rows)), min(n, len(rows))))
    return [rows[i] for i in keep]
