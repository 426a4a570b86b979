"""Thinking and tool-calling traffic on the Kimi-K2.5 replica through the real workflow and
real vLLM (issue 37): a dataset mixing `reasoning_content`, inline `<think>` and tool-call rows
goes through `snakemake extract` (per-form counts in the shard summary, each row's reasoning
inside the loss mask of the decoded token shards, history's reasoning stripped as the replica's
template strips it, the hidden-state shards verified); and regeneration in thinking mode
(`data.regenerate.reasoning_parser: kimi_k2`) writes rows with `reasoning_content` and
`content` that render back to the tokens the engine generated, tool rows regenerated turn by
turn (`tool_parser: kimi_k2`); and `snakemake all` on the extracted mixed rows trains a draft
and evaluates it in two modes (`evaluate.modes`: thinking and instant), the acceptance report
giving AL per mode and, split by vLLM's `kimi_k2` reasoning parser, of the reasoning and of
the answer; the same evaluation measures `evaluate.draft` (here a copy of this run's own
export, which must give exactly the run's own figures) and `evaluate.speed` (output tokens/s
with and without the draft, marked not representative on a CPU).

One working directory for the module, built by three Snakemake runs (five engine loads in
all): the replica is built once (briefly trained: see REPLICA) and shared by every run; the
regeneration run writes to its own `results_dir`, and `all` continues the extraction run's
(no re-extraction), its three evaluation engines (this run's draft, evaluate.draft's, the
target alone) each serving both modes. Regeneration turns every assistant turn into the
target's own, so the mixed forms are extracted as written."""

import csv
import json
import re
import shutil
import time

import pandas as pd
import pytest

from support.datasets import write_jsonl
from support.workflow_runner import SHORT_REGENERATION, hidden_dir, merged, snakemake

pytestmark = pytest.mark.vllm

KIMI = "resources/targets/tiny-kimi-k25"
CALL = {
    "id": "functions.weather:0",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]


def mixed_rows() -> list[dict]:
    """Four rows of each form; each reasoning text is unique, so it can be found by decoding."""
    rows = []
    for i in range(4):
        rows += [
            {
                "id": f"field{i}",
                "messages": [
                    {"role": "user", "content": f"What is {i} plus 2?"},
                    {
                        "role": "assistant",
                        "reasoning_content": f"Add {i} and two.",
                        "content": "ok",
                    },
                    {"role": "user", "content": "And times 3?"},
                    {
                        "role": "assistant",
                        "reasoning_content": f"Triple field {i}.",
                        "content": "x",
                    },
                ],
            },
            {
                "id": f"inline{i}",
                "messages": [
                    {"role": "user", "content": f"Spell word {i}."},
                    {"role": "assistant", "content": f"<think>Letters of word {i}.</think>W {i}."},
                    {"role": "user", "content": "And dog?"},
                    {"role": "assistant", "content": f"<think>Dog again {i}.</think>D O G."},
                ],
            },
            {
                "id": f"tool{i}",
                "tools": TOOLS,
                "messages": [
                    {"role": "user", "content": f"Weather in city {i}?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "reasoning_content": f"Call the tool for {i}.",
                        "tool_calls": [CALL],
                    },
                    {
                        "role": "tool",
                        "name": "weather",
                        "tool_call_id": "functions.weather:0",
                        "content": f"sunny {i}",
                    },
                    {
                        "role": "assistant",
                        "reasoning_content": f"The tool says sunny {i}.",
                        "content": "It is sunny.",
                    },
                ],
            },
        ]
    return rows


def tool_rows() -> list[dict]:
    """Two tool rows for regeneration (the mixed rows' form): the target answers the user turn,
    and the tool result only if it made the row's call."""
    return [{**r, "id": f"regen-{r['id']}"} for r in mixed_rows() if "tools" in r][:2]


def prompt_rows() -> list[dict]:
    """Prompt-only rows for regeneration, two user turns each (the second answered with the
    first reply in its history): sums in the replica's `reasoning` family (it starts to work
    them out in steps: replies cut at the budget) and capitals (it closes the think block and
    ends its turn: replies that end themselves)."""
    sums = [f"What is {10 + 7 * i} plus {20 + 5 * i}? Think it through." for i in range(3)]
    capitals = [f"What is the capital of {c}?" for c in ("France", "Peru", "Kenya")]
    return [{"id": f"p{i}", "turns": [q, "And once more?"]} for i, q in enumerate(sums + capitals)]


# The replica, briefly trained (about 2 minutes here) on a small corpus of two families, the
# `reasoning` one among them. What is tested here is the template, the tokenizer and the
# architecture, through vLLM; the replies must vary: 10 steps left a replica that answers every
# prompt with spaces, which its reasoning parser strips, so nothing re-rendered. At 120 steps
# no reply ended its turn either (every one was cut at the budget; the exact re-render of a
# finished reply is proven in test_reasoning_data.py).
REPLICA = {
    "target": {"path": KIMI, "trust_remote_code": True},
    "data": {"bundled_conversations": 90, "bundled_synthetic_families": ["reasoning", "capitals"]},
    "target_training": {
        "steps": 120,
        "batch_tokens": 512,
        "lr": 0.006,
        "warmup_steps": 1,
        "empty_system_phase": {"steps": 0},
    },
}


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    """The module's working directory: `results/` the mixed rows extracted, `results-regen/`
    the prompt rows regenerated in thinking mode and sharded."""
    workdir = tmp_path_factory.mktemp("kimi-traffic")
    mixed = write_jsonl(workdir / "mixed.jsonl", mixed_rows())
    prompts = write_jsonl(workdir / "prompts.jsonl", prompt_rows() + tool_rows())
    extract = merged(REPLICA, {"data": {"path": str(mixed), "shard_size": 6}})
    regen = merged(
        REPLICA,
        {
            "results_dir": "results-regen",
            "data": {
                "path": str(prompts),
                "shard_size": 8,
                "regenerate": merged(
                    SHORT_REGENERATION,
                    {
                        "reasoning_parser": "kimi_k2",
                        "tool_parser": "kimi_k2",
                        "max_new_tokens": 24,
                        "chunk_rows": 8,
                    },
                ),
            },
        },
    )
    t0 = time.time()
    snakemake(workdir, "extract", config=extract)
    print(f"replica built, mixed rows extracted: {time.time() - t0:.0f} s")
    t0 = time.time()
    snakemake(workdir, "results-regen/shards/manifest.parquet", config=regen)
    print(f"prompt rows regenerated in thinking mode and sharded: {time.time() - t0:.0f} s")
    return workdir


# `all` after the extraction: a short draft training on the mixed rows' shards, evaluated on
# the first three mixed rows (a reasoning_content, an inline <think> and a tool row, each up to
# its first user turn, the tool row with its tools) in both modes, at k = 1, with
# evaluate.speed at concurrencies 1 and 2 (the fewest that still show concurrency); the
# `evaluated` fixture adds evaluate.draft. Three engines: the run's draft, evaluate.draft's, and
# the target alone (the speed baseline). A llama draft, where auto would train the MLA draft
# (test_draft.py's `all` covers that): the suite's end-to-end run of the llama draft in vLLM.
EVALUATION = {
    "draft": {
        "architecture": "llama",
        "vocab_size": 256,
        "max_steps": 6,
        "batch_packs": 2,
        "save_every": 6,
        "eval_every": 6,
        "max_tokens": 256,
        "warmup_ratio": 0.2,
    },
    "evaluate": {
        "speculative_tokens": 1,
        "paths": ["vllm_eagle3"],
        "max_tokens": 16,
        "modes": {"thinking": {"thinking": True}, "instant": {"thinking": False}},
        "reasoning_parser": "kimi_k2",
        "speed": True,
        "speed_concurrencies": [1, 2],
    },
}


DOWNLOADED = "downloaded-draft"  # evaluate.draft: a copy of the run's export, as downloaded


@pytest.fixture(scope="module")
def evaluated(traffic):
    """`snakemake all` continuing the extraction run of `traffic`: its acceptance report.

    evaluate.draft is a copy of this run's export in a directory of its own, as a user names a
    downloaded draft: a first run trains and exports (`export/config.json`, no evaluation),
    the copy is made, then `all` evaluates both. validate_env, which checks that
    evaluate.draft holds a config.json, ran in the extraction run and does not run again (its
    rerun triggers leave out `evaluate`)."""
    mixed = traffic / "mixed.jsonl"
    fp = hidden_dir(traffic).name
    config = merged(
        merged(REPLICA, {"data": {"path": str(mixed), "shard_size": 6}}),
        merged(
            EVALUATION,
            {
                "evaluate": {
                    "sets": [{"name": "mixed", "path": str(mixed), "format": "chat", "limit": 3}],
                    "draft": DOWNLOADED,
                }
            },
        ),
    )
    export = traffic / "results" / "draft" / fp / "export"
    snakemake(traffic, str((export / "config.json").relative_to(traffic)), config=config)
    shutil.copytree(export, traffic / DOWNLOADED)
    t0 = time.time()
    proc = snakemake(traffic, config=config)
    print(
        "draft trained, exported and evaluated in two modes, beside evaluate.draft and with "
        f"evaluate.speed: {time.time() - t0:.0f} s"
    )
    out = traffic / "results" / "eval" / fp
    return {
        "fp": fp,
        "work": out / "work",
        "report": json.loads((out / "acceptance.json").read_text()),
        "table": (out / "acceptance.md").read_text(),
        "log": (traffic / "results" / "logs" / "evaluate" / f"{fp}.log").read_text(),
        "stdout": proc.stdout + proc.stderr,
    }


@pytest.fixture(scope="module")
def tok(traffic):
    from eagleflow.target.load import load_tokenizer

    return load_tokenizer(traffic / KIMI)


def decoded_samples(results, tok) -> dict[str, tuple[str, str]]:
    """sample id -> (text of its loss-masked tokens, text of the rest), from the token shards."""
    from eagleflow.data.shards import read_token_shard

    samples = {}
    for f in sorted((results / "shards" / "tokens").glob("*.safetensors")):
        shard = read_token_shard(f)
        for i, sid in enumerate(shard.sample_ids):
            ids, mask = shard.sample(i)
            m = mask.astype(bool)
            samples[sid] = (tok.decode(ids[m]), tok.decode(ids[~m]))
    return samples


def test_mixed_reasoning_and_tool_rows_are_extracted_with_reasoning_in_the_mask(traffic, tok):
    """`snakemake extract` on the mixed rows: per form, the summary counts rows, samples and
    reasoning tokens kept; each turn's reasoning is trained on in its own sample and absent
    from the samples that hold it as history (the replica renders history `<think></think>`);
    tool results are never trained on; every hidden-state shard verifies."""
    results = traffic / "results"
    summary = json.loads((results / "shards" / "summary.json").read_text())
    rows = mixed_rows()
    assert summary["conversations"] == len(rows) and summary["rejected"] == 0
    assert summary["fields_not_rendered"] == {}

    def tokens(text):
        return len(tok.encode(text, add_special_tokens=False))

    field = [
        m["reasoning_content"] for r in rows for m in r["messages"] if "reasoning_content" in m
    ]
    inline = [
        m["content"][len("<think>") : m["content"].index("</think>")]
        for r in rows
        for m in r["messages"]
        if m["content"].startswith("<think>")
    ]
    tool = [m["reasoning_content"] for r in rows if "tools" in r for m in r["messages"][1:2]]
    # reasoning_content rows: the 4 two-turn rows (2 samples each) and the 4 tool rows (one
    # sample each: no user turn between the call and the answer, history rendered as is).
    assert summary["forms"] == {
        "reasoning_content": {
            "rows": 8,
            "samples": 12,
            "reasoning_tokens": sum(map(tokens, field)),
        },
        "inline_think": {"rows": 4, "samples": 8, "reasoning_tokens": sum(map(tokens, inline))},
        "tool_calls": {
            "rows": 4,
            "samples": 4,
            "reasoning_tokens": sum(
                tokens(m["reasoning_content"])
                for r in rows
                if "tools" in r
                for m in r["messages"]
                if "reasoning_content" in m
            ),
        },
    }
    assert tool  # the tool rows' call turns carry reasoning

    samples = decoded_samples(results, tok)
    manifest = pd.read_parquet(results / "shards" / "manifest.parquet")
    assert sorted(manifest["sample_id"]) == sorted(samples)
    assert len(samples) == summary["samples"] == 20
    for i in range(4):
        for row, first, second in (
            ("field", f"Add {i} and two.", f"Triple field {i}."),
            ("inline", f"Letters of word {i}.", f"Dog again {i}."),
        ):
            trained1, rest1 = samples[f"{row}{i}#turn1"]
            trained2, rest2 = samples[f"{row}{i}#turn2"]
            assert f"<think>{first}" not in trained1 and first + "</think>" in trained1
            assert first not in rest1 and second not in trained1 + rest1
            assert second + "</think>" in trained2
            # turn 1 as history: its reasoning stripped to an empty think block
            assert first not in trained2 + rest2 and "<think></think>" in rest2
        trained, rest = samples[f"tool{i}"]
        assert f"Call the tool for {i}.</think><|tool_calls_section_begin|>" in trained
        assert f"The tool says sunny {i}.</think>It is sunny.<|im_end|>" in trained
        assert f"sunny {i}" in rest and f"sunny {i}" not in trained.replace(
            f"The tool says sunny {i}.", ""
        )

    fp = hidden_dir(traffic)
    with open(fp / "verify_summary.tsv") as f:
        verdicts = list(csv.DictReader(f, delimiter="\t"))
    assert len(verdicts) == summary["shards"] == 4
    assert all(v["ok"] == "True" and not v["problems"] for v in verdicts), verdicts


def test_regeneration_in_thinking_mode_writes_rows_that_render_back_to_the_generated_tokens(
    traffic, tok
):
    """Prompt rows answered by the replica through vLLM in thinking mode (its generation
    prompt opens `<think>`), replies kept with their special tokens and split by vLLM's
    `kimi_k2` reasoning parser: every reply is a row's `reasoning_content` + `content`, and
    the job checked each against the token ids the engine returned (a reply that ended itself
    renders to exactly them; one cut at `max_new_tokens` to them followed by the template's
    closing markers). The barely trained replica cuts some replies at the budget and, from one
    run to the next, ends others at once: `<|im_end|>` right after the prompt's `<think>`, a
    reply with nothing in it that renders back with a `</think>` it never wrote. That is the
    one mismatch allowed here, each named in the job's log; the exact case is proven with
    written-out replies in tests/test_reasoning_data.py. The shards then train on each reply's
    reasoning."""
    results = traffic / "results-regen"
    regenerated = results / "regenerated"
    (summary_file,) = regenerated.glob("*.summary.json")
    summary = json.loads(summary_file.read_text())
    rows = [
        json.loads(line)
        for line in summary_file.with_name(summary_file.name.replace(".summary.json", ".jsonl"))
        .read_text()
        .splitlines()
    ]
    prompts, tools = prompt_rows(), tool_rows()
    assert summary["rows_kept"] == len(rows) == len(prompts) + len(tools)
    assert summary["rows_rejected"] == 0
    replies = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert len(replies) == summary["replies_now"]
    assert all(set(m) <= {"role", "reasoning_content", "content", "tool_calls"} for m in replies), (
        replies
    )
    # tool rows: the user turn and the tools as given, the target's reply; the row's tool
    # result kept only after a reply that made the row's call, else the row ends there
    by_id = {r["id"]: r for r in rows}
    ended = 0
    for given in tools:
        got = by_id[given["id"]]
        assert got["tools"] == TOOLS and got["messages"][0] == given["messages"][0]
        assert got["messages"][1]["role"] == "assistant"
        if len(got["messages"]) == 2:
            ended += 1
        else:
            assert got["messages"][1]["tool_calls"] == [CALL]
            assert got["messages"][2] == given["messages"][2]
    assert summary["tool_calls_diverged_now"] == ended
    rows = [r for r in rows if r["id"].startswith("p")]
    assert len(rows) == len(prompts)
    assert all(isinstance(m["content"], str) for m in replies)
    assert any(m.get("reasoning_content") for m in replies), replies
    finished = summary["finish_reasons_now"]
    checked = summary["rerendered_now"]
    assert checked["cut"] == finished.get("length", 0), summary
    assert checked["exact"] + checked["mismatched"] == finished.get("stop", 0), summary
    log = (results / "logs" / "regenerate" / f"{summary['shard']}.log").read_text()
    named = re.findall(
        r"([\w.#-]+), reply (\d+): the written-out reply does not render back to the generated "
        r"tokens \(first difference at its token (\d+); finish reason (\w+)\)",
        log,
    )
    assert len(named) == checked["mismatched"], log[-3000:]
    for sample_id, k, at, reason in named:  # each an empty reply the target ended at once
        reply = [m for m in by_id[sample_id]["messages"] if m["role"] == "assistant"][int(k) - 1]
        assert (at, reason) == ("0", "stop"), (sample_id, k)
        assert not reply.get("reasoning_content") and reply["content"] == "", (sample_id, reply)
        assert not reply.get("tool_calls"), (sample_id, reply)
    assert summary["truncated_now"] == finished.get("length", 0)
    assert sum(checked.values()) == len(replies)  # every reply checked

    samples = decoded_samples(results, tok)
    for r in rows:  # the prompt rows
        first, second = [m for m in r["messages"] if m["role"] == "assistant"]
        if not first.get("reasoning_content"):
            # the first reply renders as history as it did as a reply: one sample trains on both
            assert f"{r['id']}#turn1" not in samples
            trained, _ = samples[r["id"]]
            one = "</think>" + first["content"] + "<|im_end|>"
            assert trained.startswith(one), (r["id"], trained)
            assert trained[len(one) :].startswith(second.get("reasoning_content", "") + "</think>")
            continue
        trained1, _ = samples[f"{r['id']}#turn1"]
        trained2, rest2 = samples[f"{r['id']}#turn2"]
        assert trained1.startswith(first["reasoning_content"] + "</think>")
        assert trained2.startswith(second.get("reasoning_content", "") + "</think>")
        # the first reply as history: its reasoning emptied to a think block
        assert "<think></think>" + first["content"] + "<|im_end|>" in rest2


def test_all_on_the_replica_reports_acceptance_per_mode_and_per_part_of_the_reply(evaluated, tok):
    """`snakemake all` on the extracted mixed rows: a draft trained, exported and evaluated by
    one vLLM engine in both modes (`evaluate.modes`). The prompts are rendered per mode (the
    instant prompt closes the think block the thinking one opens) with each row's tools;
    acceptance.md gives AL per set and mode, and of the reasoning and the answer, split by
    vLLM's `kimi_k2` parser: thinking-mode replies start in reasoning, instant ones are all
    answer."""
    from eagleflow.evaluate.turns import chat_renderer

    report, table = evaluated["report"], evaluated["table"]
    # this run's draft, evaluate.draft's and the target alone (evaluate.speed)
    assert report["engine_loads"] == 3 and report["reasoning_parser"] == "kimi_k2"
    assert report["modes"] == {"thinking": {"thinking": True}, "instant": {"thinking": False}}
    rows = mixed_rows()[:3]
    render = chat_renderer(tok)
    figures = {}
    for mode, kwargs in report["modes"].items():
        r = report["runs_by_mode"][mode]["mixed"]["1"]["vllm_eagle3"]
        assert "error" not in r, r
        figures[mode] = r
        expected = [[len(render(r0["messages"][:1], r0.get("tools", ()), kwargs))] for r0 in rows]
        assert r["prompt_tokens"] == expected, mode  # the tool row's prompt holds its tools
        assert r["prompts"] == 3 and r["num_drafts"] > 0
        assert 1.0 <= r["acceptance_length"] <= 2.0
        parts = r["by_part"]
        assert parts["reasoning"]["num_drafts"] + parts["answer"]["num_drafts"] == r["num_drafts"]
    thinking, instant = figures["thinking"], figures["instant"]
    assert thinking["by_part"]["reasoning"]["num_drafts"] > 0
    assert instant["by_part"]["reasoning"]["num_drafts"] == 0
    assert instant["by_part"]["answer"]["acceptance_length"] == instant["acceptance_length"]
    modes = list(report["modes"])  # in the config's order (the test's YAML sorts its keys)
    assert f"| engine | k | temperature | {' | '.join(f'mixed ({m})' for m in modes)} |" in table
    al = " | ".join(f"{figures[m]['acceptance_length']:.2f}" for m in modes)
    assert f"| vLLM eagle3 | 1 | 0 (greedy) | {al} |" in table
    assert "## Reasoning and answer" in table
    assert "| mixed (thinking) | vLLM eagle3 | 1 |" in table
    assert "| mixed (instant) | vLLM eagle3 | 1 |" in table
    assert "engine loads: 3 vLLM engine(s)" in evaluated["log"]
    print(
        "AL per mode:",
        {
            m: (
                f["acceptance_length"],
                {p: x["acceptance_length"] for p, x in f["by_part"].items()},
            )
            for m, f in figures.items()
        },
    )


def test_evaluate_draft_beside_the_runs_own_gives_exactly_its_figures(evaluated):
    """`evaluate.draft` through the real engine: a copy of this run's export in a directory of
    its own (as a downloaded draft), measured by an engine of its own on the same sets, modes
    and k. The same weights, greedy, with the same engine settings, one prompt at a time: every
    set, mode and k gives exactly the run's own counters (in total, per prompt, per position
    and per part of the reply), the same replies and the same AL; acceptance.md names the
    directory and gives its rows beside the run's own."""
    from eagleflow.evaluate.acceptance import GIVEN, TARGET_ALONE

    report, table = evaluated["report"], evaluated["table"]
    given_dir = DOWNLOADED
    assert report["given_draft"] == given_dir
    assert report["draft"] == f"results/draft/{evaluated['fp']}/export"
    loads = report["loads"]
    assert [x["path"] for x in loads] == [TARGET_ALONE, "vllm_eagle3", "vllm_eagle3" + GIVEN]
    # evaluate.mla null, a llama draft on the CPU: MLA off in every engine
    assert report["draft_architecture"] == "llama" and report["vllm_mla_disabled"] is True
    assert [x["vllm_mla"] for x in loads] == [False, False, False]
    # vLLM's own totals over every set and mode, in each engine
    own_total, given_total = loads[1]["counters"], loads[2]["counters"]
    assert own_total == given_total and own_total["1"]["num_drafts"] > 0, loads
    counters = ["num_drafts", "num_draft_tokens", "num_accepted_tokens"]
    counters += ["num_accepted_tokens_per_pos", "per_prompt", "by_part", "acceptance_length"]
    modes = list(report["modes"])
    figures = {}
    for mode in modes:
        by_k = report["runs_by_mode"][mode]["mixed"]
        assert list(by_k) == ["1"]
        own, given = by_k["1"]["vllm_eagle3"], by_k["1"]["vllm_eagle3" + GIVEN]
        assert "error" not in given, given
        for key in counters:
            assert given[key] == own[key], (mode, key, given[key], own[key])
        assert given["output_token_ids"] == own["output_token_ids"], mode
        assert given == own, mode  # and everything else: texts, prompt tokens, interval
        # The replica's replies vary (62 drafts, 30 accepted in the by-hand check of two loads:
        # docs/measurements/evaluation-sets.md, 2026-12-07), so this is no trivial agreement.
        figures[mode] = given
    assert report["runs"] == report["runs_by_mode"][modes[0]]

    assert f"| draft (evaluate.draft) | `{given_dir}` |" in table
    assert "| engine loads | 3 |" in table
    al = " | ".join(f"{figures[m]['acceptance_length']:.2f}" for m in modes)
    assert f"| vLLM eagle3 | 1 | 0 (greedy) | {al} |" in table
    assert f"| vLLM eagle3 (evaluate.draft) | 1 | 0 (greedy) | {al} |" in table
    for m in modes:
        f = figures[m]
        iv = f["interval"]
        per_pos = ", ".join(str(x) for x in f["num_accepted_tokens_per_pos"])
        assert (
            f"| mixed ({m}) | all | vLLM eagle3 (evaluate.draft) | 1 | 0 (greedy) | "
            f"{f['acceptance_length']:.2f} | [{iv['low']:.2f}, {iv['high']:.2f}] | 3 | "
            f"{f['num_drafts']} | {per_pos} |"
        ) in table
        reasoning, answer = f["by_part"]["reasoning"], f["by_part"]["answer"]
        parts = " | ".join(
            f"{x['acceptance_length']:.2f}" if x["num_drafts"] else "-" for x in (reasoning, answer)
        )
        assert (
            f"| mixed ({m}) | vLLM eagle3 (evaluate.draft) | 1 | 0 (greedy) | "
            f"{f['acceptance_length']:.2f} | {parts} | {reasoning['num_drafts']} | "
            f"{answer['num_drafts']} |"
        ) in table
    print(
        "evaluate.draft against the run's own:",
        {
            m: (f["num_drafts"], f["num_accepted_tokens"], f["acceptance_length"])
            for m, f in figures.items()
        },
        "load wall s:",
        {x["path"]: x["wall_s"] for x in loads},
    )


def test_speed_with_and_without_the_draft_through_the_engine_marked_on_a_cpu(evaluated):
    """`evaluate.speed` through the real engine: the target alone (an engine of its own,
    measured for its speed only) and each eagle3 engine after its acceptance figures generate
    c requests of `evaluate.max_tokens` tokens each at c = 1 and 2; the report gives the tokens/s
    of both and their quotient per concurrency, marked not representative on a CPU, and
    acceptance.md the same table."""
    from eagleflow.evaluate.acceptance import GIVEN

    report, table, work = evaluated["report"], evaluated["table"], evaluated["work"]
    speed = report["speed"]
    assert speed["device"] == "cpu" and speed["representative"] is False
    assert speed["note"] == "measured on a CPU engine: not representative of a GPU's speed-up"
    alone = speed["target_alone"]
    tokens = [16 * c for c in (1, 2)]  # max_tokens each, the end of turn ignored
    assert [r["concurrency"] for r in alone] == [1, 2]
    assert [r["output_tokens"] for r in alone] == tokens
    assert all(r["tokens_per_second"] > 0 for r in alone), alone
    # the engines' own files: the target alone measured nothing else, and the eagle3 engines
    # generated as many tokens as it did
    target_alone = json.loads((work / "none-k0.json").read_text())
    assert target_alone["records"] == [] and target_alone["speed"] == alone
    for name in ("eagle3-k1.json", "eagle3-k1-given.json"):
        run = json.loads((work / name).read_text())
        assert [r["output_tokens"] for r in run["speed"]] == tokens, name
    base = {r["concurrency"]: r["tokens_per_second"] for r in alone}
    rows = speed["rows"]
    paths = ["vllm_eagle3", "vllm_eagle3" + GIVEN]
    assert [(r["path"], r["k"], r["concurrency"]) for r in rows] == [
        (p, 1, c) for p in paths for c in (1, 2)
    ]
    lines = [
        "## Speed-up (output tokens/s, the same prompts and engine settings)",
        f"**{speed['note']}.**",
        "| engine | k | temperature | concurrency | target alone | with draft | ratio |",
    ]
    for r in rows:
        c = r["concurrency"]
        assert r["target_alone_tokens_per_second"] == base[c]
        assert r["tokens_per_second"] > 0
        assert r["speedup"] == round(r["tokens_per_second"] / base[c], 3), r
        label = "vLLM eagle3" + (GIVEN if r["path"].endswith(GIVEN) else "")
        lines.append(
            f"| {label} | 1 | 0 (greedy) | {c} | {base[c]} | {r['tokens_per_second']} | "
            f"{r['speedup']:.2f}x |"
        )
    for line in lines:
        assert line in table, line
    assert "speed: {" in evaluated["log"]
    print(
        "speed (CPU, not representative): target alone",
        base,
        "with draft",
        [(r["path"], r["concurrency"], r["tokens_per_second"], r["speedup"]) for r in rows],
    )
