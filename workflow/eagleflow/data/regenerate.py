"""Response regeneration: the target's own greedy replies replace the dataset's assistant turns.

A draft is judged by how often it guesses what the *target* says, so it should learn from the
target's outputs rather than from whoever wrote the dataset (the EAGLE-3 authors and SpecForge
regenerate responses the same way). Every conversation keeps its system and user turns; its
assistant turns are dropped and each user turn is answered by the target, greedily, through
vLLM (`LLM.generate`), with the target's own earlier replies in the context. Round r answers
the r-th user turn of every conversation in one batched `generate` call.

Prompt-only datasets (a list of user turns per row: MT-Bench's `{"question_id", "turns"}`, or
`messages` without assistant turns) are read the same way and come out completed.

Sample ids are kept (the row's `id` / `question_id`, else the content hash of the row as read),
so the held-out split (`eagleflow.data.heldout`) is the same before and after regeneration.
A conversation whose first prompt is already `max_prompt_tokens` long has nothing left to
train on: it is a bad row (`data.on_bad_row`), named with its file and row.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from eagleflow.data.conversations import BadRow, Conversation, DatasetError, read_conversations
from eagleflow.engine.settings import EngineSettings


def prompt_turns(messages) -> list[dict]:
    """A conversation's turns without its assistant turns."""
    return [
        {"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "assistant"
    ]


def regenerate_conversations(
    conversations: list[Conversation], generate, render, max_prompt_tokens: int, log=print
):
    """(rows, bad): `rows` are {"id", "messages"} with every user turn answered by `generate`.

    render(messages) -> prompt token ids (chat template plus generation prompt);
    generate(list of prompt token-id lists) -> list of reply texts, in order.
    A conversation stops (its later turns dropped) once its next prompt would be at least
    `max_prompt_tokens` long: sharding truncates there anyway.
    """
    pending = [prompt_turns(c.messages) for c in conversations]
    done: list[list[dict]] = [[] for _ in conversations]
    answered = [0] * len(conversations)
    stopped_early = 0
    rounds = 0
    while True:
        batch = []
        for i in range(len(conversations)):
            moved = []
            while pending[i]:
                m = pending[i].pop(0)
                moved.append(m)
                if m["role"] == "user":
                    break
            if not moved or moved[-1]["role"] != "user":
                continue  # nothing left to answer (trailing non-user turns are dropped)
            ids = render(done[i] + moved)
            if len(ids) >= max_prompt_tokens:
                stopped_early += bool(pending[i]) or answered[i] > 0
                pending[i] = []
                continue
            done[i] += moved
            batch.append((i, ids))
        if not batch:
            break
        t0 = time.time()
        replies = generate([ids for _, ids in batch])
        if len(replies) != len(batch):
            raise RuntimeError(f"generate returned {len(replies)} replies for {len(batch)} prompts")
        for (i, _), text in zip(batch, replies):
            done[i].append({"role": "assistant", "content": text})
            answered[i] += 1
        rounds += 1
        log(f"round {rounds}: {len(batch)} prompts answered in {time.time() - t0:.1f}s")
    rows, bad = [], []
    for c, msgs, n in zip(conversations, done, answered):
        if n == 0:
            bad.append(
                BadRow(
                    c.source_file,
                    c.source_row,
                    f"the first prompt is at least {max_prompt_tokens} tokens long: "
                    "nothing left for the target to answer",
                    c.sample_id,
                )
            )
            continue
        rows.append({"id": c.sample_id, "messages": msgs})
    stats = {
        "conversations": len(rows),
        "rounds": rounds,
        "replies": sum(answered),
        "stopped_early": stopped_early,
        "rejected": len(bad),
    }
    return rows, bad, stats


def vllm_generator(settings: EngineSettings, max_new_tokens: int):
    """generate(prompt id lists) -> greedy reply texts through vLLM's `LLM.generate` (stops at
    the tokenizer's end-of-turn token or after `max_new_tokens`), and the finish counts.

    `settings.max_num_seqs`: vLLM's cap on sequences decoded together (None: vLLM's default);
    one `generate` call hands vLLM a whole round, so on a CPU a larger cap means fewer, fuller
    decode steps. `settings.mla=False` builds the DeepSeek attention as `DeepseekV2Attention`
    (the latent `kv_a_proj_with_mqa` -> `kv_a_layernorm` -> `kv_b_proj` up-projection run at
    every step and full per-head K/V cached) instead of `DeepseekV2MLAAttention` (the latent
    cached, `kv_b_proj` absorbed into the query/output): the same weights and, on paper, the
    same function, decoded much faster by vLLM's CPU backend (docs/measurements/)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagleflow.engine.builder import build_engine

    # CUDA graphs speed up decoding on GPUs; the CPU backend runs eager.
    llm = build_engine(settings, eager=settings.device == "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    finished = {"stop": 0, "length": 0}

    def generate(prompts):
        t0 = time.time()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params)
        for o in outputs:
            reason = o.outputs[0].finish_reason
            finished[reason] = finished.get(reason, 0) + 1
            generate.stats["generated_tokens"] += len(o.outputs[0].token_ids)
        generate.stats["generate_s"] += time.time() - t0
        return [o.outputs[0].text for o in outputs]

    generate.stats = {"generated_tokens": 0, "generate_s": 0.0}
    return generate, finished


def chat_renderer(tokenizer):
    def render(messages):
        out = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])

    return render


def regenerate_dataset(
    dataset_path,
    target_dir,
    out_path,
    rejects_path,
    max_length: int,
    max_new_tokens: int,
    on_bad_row: str = "error",
    engine: EngineSettings | None = None,
    generate=None,
    log=print,
) -> dict:
    """Read `dataset_path` (complete or prompt-only rows), answer every user turn with the
    target through vLLM, write the completed conversations as JSONL (`id`, `messages`) to
    `out_path` and bad rows to `rejects_path`. `generate` replaces vLLM (tests)."""
    from eagleflow.target.load import load_tokenizer

    t0 = time.time()
    conversations, bad = read_conversations(dataset_path, require_assistant=False)
    if bad and on_bad_row == "error":
        raise DatasetError(f"{bad[0].message()} ({len(bad)} bad rows in all)")
    if not conversations:
        raise DatasetError(f"{dataset_path}: no usable conversations")
    tokenizer = load_tokenizer(target_dir)
    finished = None
    if generate is None:
        settings = engine or EngineSettings(
            str(target_dir), max_model_len=max_length + max_new_tokens
        )
        generate, finished = vllm_generator(settings, max_new_tokens)
    started = time.time() - t0
    rows, more_bad, stats = regenerate_conversations(
        conversations, generate, chat_renderer(tokenizer), max_length, log
    )
    if more_bad and on_bad_row == "error":
        raise DatasetError(f"{more_bad[0].message()} ({len(more_bad)} such rows in all)")
    bad = sorted(bad + more_bad, key=lambda b: b.source_row)
    out_path, rejects_path = Path(out_path), Path(rejects_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out_path)
    with open(rejects_path, "w", encoding="utf-8") as f:
        for b in bad:
            f.write(
                json.dumps(
                    {
                        "source_file": b.source_file,
                        "source_row": b.source_row,
                        "reason": b.reason,
                        "raw": b.raw,
                    }
                )
                + "\n"
            )
    summary = {
        **stats,
        "rejected": len(bad),
        "finish_reasons": finished,
        "max_new_tokens": max_new_tokens,
        "max_length": max_length,
        "seconds": round(time.time() - t0, 1),
        "engine_start_s": round(started, 1),
    }
    stats = getattr(generate, "stats", None)
    if stats and stats["generate_s"] > 0:
        summary.update(
            generated_tokens=stats["generated_tokens"],
            generate_s=round(stats["generate_s"], 1),
            tokens_per_s=round(stats["generated_tokens"] / stats["generate_s"], 1),
        )
    log(f"regenerated {dataset_path} with {target_dir}: {json.dumps(summary)}")
    return summary
