"""Reading chat datasets (JSONL, JSON, Parquet; OpenAI and ShareGPT layouts) into one form.

Every row becomes either a `Conversation` or a `BadRow` naming file, row and reason:
nothing disappears silently. What to do with bad rows is the caller's decision
(`on_bad_row: error | skip`).

OpenAI rows keep every message field a chat template reads: `reasoning_content` (also given
as `reasoning`, or inline as `<think>...</think>` before the answer in `content`, split off the
way Qwen3's template splits it), `tool_calls`, `tool_call_id`, `name`, the `tool` role, and the
row's `tools` list. Whether the target's template renders them is found by rendering
(eagleflow.data.templating), never assumed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from eagleflow.logs import UserError

# ShareGPT speaker names -> OpenAI roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "system": "system",
}
ROLES = {"system", "user", "assistant", "tool"}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    messages: tuple[dict, ...]  # OpenAI form: ({"role": ..., "content": ..., [fields]}, ...)
    source_file: str
    source_row: int  # 1-based line (JSONL) or 0-based record index (JSON, Parquet)
    tools: tuple[dict, ...] = ()  # the row's `tools` (function declarations), if any
    forms: tuple[str, ...] = ()  # FORMS the row was given in (for the shard summary)


# How a row carries reasoning and tool traffic, counted per form in the shard summary.
FORMS = ("reasoning_content", "inline_think", "tool_calls")


def record_forms(messages: tuple[dict, ...], record: dict) -> tuple[str, ...]:
    """The FORMS of a normalized row (`record`: the row as read)."""
    raw = record.get("messages") if isinstance(record.get("messages"), list) else []
    given = any(
        isinstance(t, dict) and t.get(k) not in (None, "")
        for t in raw
        for k in ("reasoning_content", "reasoning")
    )
    split = any("reasoning_content" in m for m in messages) and not given
    tools = record.get("tools") or any("tool_calls" in m or m["role"] == "tool" for m in messages)
    return tuple(f for f, on in zip(FORMS, (given, split, bool(tools))) if on)


@dataclass(frozen=True)
class BadRow:
    source_file: str
    source_row: int
    reason: str
    raw: str

    def message(self) -> str:
        return (
            f"{self.source_file}, row {self.source_row}: {self.reason}. Fix the row, or set "
            "`data.on_bad_row: skip` to write such rows to the rejects file and go on."
        )


class DatasetError(UserError, ValueError):
    pass


def jsonl_lines(path: str | Path):
    """(1-based line number, bytes without the line end) of every non-blank line, undecoded:
    a line that is not UTF-8 is one bad row, not an error for the whole file."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip(b"\r\n")
            if line.strip():
                yield lineno, line


def _records(path: Path):
    """Yield (row_number, record or parse-error string, raw text)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for lineno, raw in jsonl_lines(path):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                text = raw.decode("utf-8", errors="replace")
                yield lineno, f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1})", text
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, f"malformed JSON ({e.msg} at column {e.colno})", line
            except RecursionError:
                yield lineno, "JSON nested too deeply to read", line[:2000]
            else:
                yield lineno, record, line
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from e
        except RecursionError:
            raise DatasetError(f"{path}: JSON nested too deeply to read") from None
        if not isinstance(data, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of conversations")
        for i, record in enumerate(data):
            yield i, record, json.dumps(record)[:2000]
    elif suffix == ".parquet":
        for i, record in enumerate(pd.read_parquet(path).to_dict(orient="records")):
            record = {k: _plain(v) for k, v in record.items()}
            yield i, record, json.dumps(record, default=str)[:2000]
    else:
        raise DatasetError(
            f"{path}: unknown dataset format {suffix!r}; use .jsonl, .json or .parquet"
        )


def _plain(value):
    """Parquet gives numpy arrays for list columns; turn them back into lists and dicts."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def normalize_messages(record: dict, require_assistant: bool = True) -> tuple[dict, ...]:
    """OpenAI `messages`, ShareGPT `conversations` or MT-Bench `turns` (a list of user turns)
    -> OpenAI messages; ValueError says why not. Prompt-only rows (no assistant turn: `turns`,
    or messages without one) pass only with `require_assistant=False` (response regeneration
    completes them)."""
    if "turns" in record and "messages" not in record and "conversations" not in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("empty `turns`")
        for i, turn in enumerate(turns):
            if not isinstance(turn, str):
                raise ValueError(f"turn {i} of `turns` is not a string")
        record = {"messages": [{"role": "user", "content": t} for t in turns]}
    if "messages" in record:
        turns, role_key, text_key, names = record["messages"], "role", "content", None
    elif "conversations" in record:
        turns, role_key, text_key, names = record["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise ValueError(
            "no `messages` (OpenAI), `conversations` (ShareGPT) or `turns` (prompts) field"
        )
    if not isinstance(turns, list) or not turns:
        raise ValueError("empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        calls = isinstance(turn, dict) and names is None and turn.get("tool_calls")
        if (
            not isinstance(turn, dict)
            or role_key not in turn
            or (text_key not in turn and not calls)
        ):
            raise ValueError(f"turn {i} lacks `{role_key}` or `{text_key}`")
        speaker = turn[role_key]
        role = names.get(speaker) if names is not None else (speaker if speaker in ROLES else None)
        if role is None:
            raise ValueError(f"turn {i} has unknown role {speaker!r}")
        content = turn.get(text_key)
        message = {"role": role, "content": "" if content is None and calls else _text(content, i)}
        if names is None:
            message.update(_fields(turn, role, message["content"], i))
        messages.append(message)
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn")  # prompt-only rows: data.regenerate.enabled
    if not require_assistant and not any(m["role"] == "user" for m in messages):
        raise ValueError("no user turn to answer")
    return tuple(messages)


def _fields(turn: dict, role: str, content: str, i: int) -> dict:
    """The template-read fields of OpenAI turn i (content included when reasoning is split off
    it); ValueError names a malformed one."""
    out = {}
    # An empty reasoning (many datasets carry `reasoning_content: ""` on every turn) is none.
    given = [k for k in ("reasoning_content", "reasoning") if turn.get(k) not in (None, "")]
    if given:
        values = {turn[k] for k in given if isinstance(turn[k], str)}
        if len(values) != 1 or not all(isinstance(turn[k], str) for k in given):
            raise ValueError(
                f"turn {i}: `reasoning_content` and `reasoning` must be one string (both given "
                "and different, or not a string)"
            )
        if role != "assistant":
            raise ValueError(f"turn {i}: reasoning on a {role} turn; only assistant turns reason")
        out["reasoning_content"] = values.pop()
    elif role == "assistant" and THINK_CLOSE in content:
        # Inline reasoning (DeepSeek-R1 / OpenThoughts), split as Qwen3's template splits it.
        if content.count(THINK_CLOSE) > 1:
            raise ValueError(f"turn {i}: {content.count(THINK_CLOSE)} `{THINK_CLOSE}` in content")
        reasoning, _, answer = content.partition(THINK_CLOSE)
        out["reasoning_content"] = reasoning.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
        out["content"] = answer.lstrip("\n")
    calls = turn.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"turn {i}: `tool_calls` on a {role} turn")
        if not isinstance(calls, list):
            raise ValueError(f"turn {i}: `tool_calls` is not a list")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"turn {i}: tool call {j} lacks `function.name`")
            if not isinstance(fn.get("arguments", ""), (str, dict)):
                raise ValueError(f"turn {i}: tool call {j} `function.arguments` is not JSON text")
        if calls:
            out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if turn.get(key) is not None:
            if not isinstance(turn[key], str):
                raise ValueError(f"turn {i}: `{key}` is not a string")
            out[key] = turn[key]
    return out


def normalize_tools(record: dict) -> tuple[dict, ...]:
    """The row's `tools` (a list of declarations, or that list as JSON text, as some
    datasets store it); ValueError says why not."""
    tools = record.get("tools")
    if tools is None:
        return ()
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"`tools` is text but not JSON ({e.msg})") from e
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("`tools` is not a list of tool declarations (objects)")
    return tuple(tools)


def _text(content, i: int) -> str:
    """A turn's text: a string, or OpenAI's list of content parts (`[{"type": "text", "text":
    ...}]`), whose text parts are joined; any other part makes the row bad, named by type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"turn {i} content is neither a string nor a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"turn {i} content part {j} is of type {kind!r}; only text is read")
        texts.append(part["text"])
    return "".join(texts)


def content_id(messages: tuple[dict, ...], tools: tuple[dict, ...] = ()) -> str:
    """A hash of the conversation (and its tools, when it has any: rows without keep the ids
    they had before tools were read)."""
    content = {"messages": messages, "tools": tools} if tools else messages
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_conversations(
    paths,
    require_assistant: bool = True,
    rows: tuple[int, int] | None = None,
    seen: set | None = None,
) -> tuple[list[Conversation], list[BadRow]]:
    """Conversations and bad rows of one dataset file, or of several read one after another
    (sample ids unique across all). `rows`: only records [start, end) in reading order (blank
    JSONL lines are not records): one source shard (eagleflow.regenerate.sources). `seen`: sample
    ids of files read before (updated)."""
    good, bad = [], []
    seen = set() if seen is None else seen
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        _read_file(Path(path), require_assistant, rows, good, bad, seen)
    return good, bad


def _read_file(path: Path, require_assistant, rows, good, bad, seen) -> None:
    if not path.exists():
        raise DatasetError(f"{path}: dataset file not found; set `data.path` in the config")
    records = _records(path)
    if rows is not None:
        records = itertools.islice(records, rows[0], rows[1])
    for row, record, raw in records:
        if isinstance(record, str):
            bad.append(BadRow(str(path), row, record, raw))
            continue
        if not isinstance(record, dict):
            bad.append(BadRow(str(path), row, "row is not a JSON object", raw))
            continue
        try:
            messages = normalize_messages(record, require_assistant)
            tools = normalize_tools(record) if "messages" in record else ()
            source = record.get("source")
            if isinstance(source, dict) and {"file", "row"} <= source.keys():
                # a regenerated row (eagleflow.regenerate.shard) names the dataset row it answers
                origin = (str(source["file"]), int(source["row"]))
            else:
                origin = (str(path), row)
            given = record.get("id", record.get("question_id"))
            sample_id = str(given) if given is not None else content_id(messages, tools)
        except ValueError as e:
            bad.append(BadRow(str(path), row, str(e), raw))
            continue
        except Exception as e:  # any other per-row failure is this row's, named
            bad.append(BadRow(str(path), row, f"unreadable row ({type(e).__name__}: {e})", raw))
            continue
        if sample_id in seen:
            bad.append(BadRow(*origin, f"duplicate sample id {sample_id!r}", raw))
            continue
        seen.add(sample_id)
        good.append(
            Conversation(sample_id, messages, *origin, tools, record_forms(messages, record))
        )
