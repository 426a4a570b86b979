"""Load target + exported EAGLE-3 draft in vLLM, generate, and report vLLM's spec-decode counters.

Run as a subprocess (`python -m eagleflow.spec_decode_check --target T --draft D --out J`) so
the engine's environment stays its own. On CPU the MLA target and a Llama-style draft clash
on the KV block size (CPU_MLA wants 16, CPU_ATTN multiples of 32; field notes 11), so
`--no-mla` (the default on CPU) runs the target's non-MLA attention path
(VLLM_MLA_DISABLE=1), set here before vLLM is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import time


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


def run(target: str, draft: str, k: int, prompts: list[str], max_tokens: int, no_mla: bool) -> dict:
    if no_mla:
        os.environ["VLLM_MLA_DISABLE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=target,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": k},
        enforce_eager=True,
        max_model_len=512,
        max_num_batched_tokens=512,
        disable_log_stats=False,
        enable_prefix_caching=False,
        seed=0,
    )
    started = time.time() - t0
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True))
    counters = spec_counters(llm.get_metrics())
    drafts = counters.get("num_drafts", 0)
    accepted = counters.get("num_accepted_tokens", 0)
    return {
        "k": k,
        "engine_start_s": round(started, 1),
        "total_s": round(time.time() - t0, 1),
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "counters": counters,
        # mean tokens per target forward: 1 (the target's own) + accepted drafts per draft run
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "texts": [o.outputs[0].text for o in outputs],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt", action="append")
    p.add_argument("--mla", action="store_true", help="keep the target's MLA path (GPU)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    result = run(a.target, a.draft, a.k, a.prompt or ["What is 12 plus 7?", "Spell the word cat."],
                 a.max_tokens, not a.mla)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "texts"}))


if __name__ == "__main__":
    main()
