"""Load target + exported EAGLE-3 draft in vLLM, generate, and report vLLM's spec-decode counters.

Run as a subprocess (`python -m eagleflow.evaluate.spec_decode_check --engine E --draft D --out J`)
so the engine's environment stays its own. On CPU the MLA target and a Llama-style draft clash
on the KV block size (CPU_MLA wants 16, CPU_ATTN multiples of 32; field notes 11), so the
evaluation's engine settings run the target's non-MLA attention path there (`mla: false`,
VLLM_MLA_DISABLE=1, set by the engine builder before vLLM is imported). An MLA draft is the
mirror image: it runs only with MLA on. `evaluate.mla: null` gives each engine what its draft
needs (`eagleflow.evaluate.acceptance.engine_for_draft`; docs/draft-export.md).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from eagleflow.engine.settings import EngineSettings


@dataclass(frozen=True)
class Speculation:
    method: str  # eagle3, ngram, or none (the target alone: the speed baseline)
    k: int  # speculative tokens per step
    draft: str | None = None  # exported draft directory (eagle3)

    def config(self) -> dict | None:
        if self.method == "none":
            return None
        if self.method == "eagle3":
            return {"method": "eagle3", "model": self.draft, "num_speculative_tokens": self.k}
        if self.method == "ngram":  # field notes 11
            return {
                "method": "ngram",
                "num_speculative_tokens": self.k,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
        raise ValueError(f"unknown method {self.method!r}")


def spec_counters(metrics) -> dict:
    """vllm:spec_decode_* counters from `LLM.get_metrics()` (per-position as a list)."""
    out = {}
    for m in metrics:
        if not m.name.startswith("vllm:spec_decode"):
            continue
        key = m.name.removeprefix("vllm:spec_decode_")
        if hasattr(m, "values"):  # Vector (per position)
            out[key] = list(m.values)
        elif hasattr(m, "value"):
            out[key] = m.value
    return out


def start_engine(settings: EngineSettings, speculation: Speculation):
    """The target with `speculation` in vLLM, its spec-decode counters on."""
    from eagleflow.engine.builder import build_engine

    return build_engine(
        settings,
        speculative_config=speculation.config(),
        disable_log_stats=False,  # the spec-decode counters are stats
        enable_prefix_caching=False,
    )


def run(
    settings: EngineSettings,
    speculation: Speculation,
    prompts: list,
    max_tokens: int,
    ignore_eos: bool = True,
    per_prompt: bool = False,
) -> dict:
    """`prompts`: strings, or lists of token ids (already chat-templated). `per_prompt`:
    generate one prompt at a time and record each prompt's counters (the difference of vLLM's
    cumulative counters around it) under `per_prompt_counters`, for an interval over prompts;
    greedy outputs are the same, only slower than one batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = start_engine(settings, speculation)
    started = time.time() - t0
    inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    t1 = time.time()
    per_prompt_counters = None
    if per_prompt:
        outputs, per_prompt_counters = [], []
        before = spec_counters(llm.get_metrics())
        for x in inputs:
            outputs += llm.generate([x], sampling, use_tqdm=False)
            after = spec_counters(llm.get_metrics())
            per_prompt_counters.append(counter_difference(after, before))
            before = after
    else:
        outputs = llm.generate(inputs, sampling)
    generate_s = time.time() - t1
    counters = spec_counters(llm.get_metrics())
    drafts = counters.get("num_drafts", 0)
    accepted = counters.get("num_accepted_tokens", 0)
    return {
        "k": speculation.k,
        "method": speculation.method,
        "generate_s": round(generate_s, 2),
        "engine_start_s": round(started, 1),
        "total_s": round(time.time() - t0, 1),
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "counters": counters,
        # mean tokens per target forward: 1 (the target's own) + accepted drafts per draft run
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "texts": [o.outputs[0].text for o in outputs],
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        **({"per_prompt_counters": per_prompt_counters} if per_prompt else {}),
    }


def run_conversations(
    settings: EngineSettings, speculation: Speculation, items: list[dict], job: dict
) -> dict:
    """One engine load (target + this speculation) for every prompt of every set in every
    mode, one prompt at a time, turn by turn (`eagleflow.evaluate.turns`). `items`:
    {`messages`, `followups`, `tools`, `chat_template_kwargs` (the item's mode's)}; `job`:
    `max_tokens`, `temperature`, `seed`, `max_prompt_tokens`, `chat_template_kwargs`,
    `reasoning_parser` (replies split into reasoning and answer). Each prompt's counters are
    the difference of vLLM's cumulative counters around its turns; `counters` are vLLM's own
    totals at the end."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagleflow.evaluate.turns import chat_renderer, reply_parts, run_conversation
    from eagleflow.target.load import load_tokenizer

    t0 = time.time()
    llm = start_engine(settings, speculation)
    started = time.time() - t0
    tok = load_tokenizer(settings.target)

    def generate(ids: list[int], stop=(), max_tokens: int | None = None):
        sampling = SamplingParams(
            temperature=float(job["temperature"]),
            seed=int(job["seed"]),
            max_tokens=int(max_tokens or job["max_tokens"]),
            stop_token_ids=sorted(stop) or None,  # a stop token stays in the output ids
        )
        before = spec_counters(llm.get_metrics())
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        return list(out[0].outputs[0].token_ids), counter_difference(
            spec_counters(llm.get_metrics()), before
        )

    render = chat_renderer(tok, job.get("chat_template_kwargs"))
    parts = reply_parts(job.get("reasoning_parser"), tok)
    t1 = time.time()
    records = []
    if speculation.method != "none":  # the target alone is measured for its speed only
        records = [
            run_conversation(
                item,
                render,
                generate,
                lambda ids: tok.decode(ids, skip_special_tokens=True),
                speculation.k,
                job.get("max_prompt_tokens"),
                parts,
                int(job["max_tokens"]),
            )
            for item in items
        ]
    result = {
        "k": speculation.k,
        "method": speculation.method,
        "engine_loads": 1,
        "engine_start_s": round(started, 1),
        "generate_s": round(time.time() - t1, 2),
        "counters": spec_counters(llm.get_metrics()),
        "records": records,
    }
    if job.get("speed_concurrencies"):
        limit = job.get("max_prompt_tokens")
        first_turns = [
            render(list(item["messages"]), item.get("tools"), item.get("chat_template_kwargs"))
            for item in items
        ]
        first_turns = [ids for ids in first_turns if limit is None or len(ids) <= limit]
        result["speed"] = measure_speed(
            llm.generate,
            [TokensPrompt(prompt_token_ids=ids) for ids in first_turns],
            job["speed_concurrencies"],
            SamplingParams(
                temperature=float(job["temperature"]),
                seed=int(job["seed"]),
                max_tokens=int(job["max_tokens"]),
                ignore_eos=True,
            ),
        )
    return result


def measure_speed(generate, prompts: list, concurrencies, sampling) -> list[dict]:
    """Output tokens per second at each concurrency c: c requests (the prompts in order,
    repeated when fewer) submitted together in one `generate` call, every request generating
    `sampling.max_tokens` tokens (end of turn ignored, so that the with- and without-draft
    runs generate the same number); after one warm-up request."""
    if not prompts:
        return []
    generate(prompts[:1], sampling, use_tqdm=False)  # warm-up: first-call costs
    out = []
    for c in concurrencies:
        batch = [prompts[i % len(prompts)] for i in range(int(c))]
        t0 = time.perf_counter()
        outputs = generate(batch, sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        out.append(
            {
                "concurrency": int(c),
                "output_tokens": tokens,
                "seconds": round(seconds, 4),
                "tokens_per_second": round(tokens / seconds, 2),
            }
        )
    return out


def counter_difference(after: dict, before: dict) -> dict:
    """`after` - `before` for counters from `spec_counters` (a counter missing before is 0)."""
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            prev = before.get(key) or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, prev)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", required=True, help="EngineSettings as JSON")
    p.add_argument("--draft", help="exported draft directory (method eagle3)")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "ngram", "none"])
    p.add_argument("--prompt-ids", help="JSON file: a list of token-id lists (chat-templated)")
    p.add_argument("--stop-at-eos", action="store_true")
    p.add_argument("--per-prompt", action="store_true", help="counters of each prompt too")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt", action="append")
    p.add_argument(
        "--conversations",
        help="JSON file {items: [{messages, followups}], job: {...}} (run_conversations)",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.method == "eagle3" and not a.draft:
        p.error("--draft is required for method eagle3")
    if a.conversations:
        with open(a.conversations) as f:
            given = json.load(f)
        result = run_conversations(
            EngineSettings(**json.loads(a.engine)),
            Speculation(a.method, a.k, a.draft),
            given["items"],
            given["job"],
        )
        with open(a.out, "w") as f:
            json.dump(result, f)
        print(json.dumps({k: v for k, v in result.items() if k != "records"}))
        return
    if a.prompt_ids:
        with open(a.prompt_ids) as f:
            prompts = json.load(f)
    else:
        prompts = a.prompt or ["What is 12 plus 7?", "Spell the word cat."]
    result = run(
        EngineSettings(**json.loads(a.engine)),
        Speculation(a.method, a.k, a.draft),
        prompts,
        a.max_tokens,
        ignore_eos=not a.stop_at_eos,
        per_prompt=a.per_prompt,
    )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    skip = ("texts", "output_token_ids", "per_prompt_counters")
    print(json.dumps({k: v for k, v in result.items() if k not in skip}))


def engine_argument(settings: EngineSettings) -> str:
    """`--engine` for `settings`."""
    return json.dumps(asdict(settings))


if __name__ == "__main__":
    main()
