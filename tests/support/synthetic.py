"""Extracted shards made without vLLM (random states through the real shard-file and chunk
commit path), for tests of verification, integrity and caching."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from eagleflow.capture.plan import CapturePlan, Strategy
from eagleflow.data.conversations import Conversation
from eagleflow.data.shards import build_shards, write_token_shard
from eagleflow.data.templating import tokenize_conversation, tokenizer_digest
from eagleflow.embedded.bundled_data import generate_conversations
from eagleflow.extract.shard import chunk_targets, finish_shard, prepare_shard_file
from eagleflow.store.chunks import ShardChunks
from eagleflow.store.headers import file_sha256
from eagleflow.store.quant import DEFAULT_STORAGE, is_fp8, quantize

FP = "0123456789abcdef"
PLAN = CapturePlan(
    strategy=Strategy.AUX_LAYERS,
    requested_strategy="auto",
    layer_ids=[2, 4, 5, 8],
    num_hidden_layers=8,
    hidden_size=16,
    architecture="DeepseekV3ForCausalLM",
    wrapper=None,
    llama_4_scaling=None,
    vllm_version="synthetic",
    device="cpu",
    checks_passed=[],
    fingerprint=FP,
)


def make_token_shards(tokenizer, n=8, size=4, seed=0):
    convs = [
        Conversation(r["id"], tuple(r["messages"]), "f", i)
        for i, r in enumerate(generate_conversations(n, seed))
    ]
    toks = [tokenize_conversation(tokenizer, c.messages, 512) for c in convs]
    return build_shards(convs, toks, size, tokenizer_digest(tokenizer))


def make_extracted_shard(
    shard,
    out_dir: Path,
    fp=FP,
    plan=PLAN,
    chunk_tokens=64,
    seed=0,
    storage_dtype=DEFAULT_STORAGE,
    keep_partial=False,
):
    """Commit every chunk into the shard file as the worker would (in fp8 storage: quantized,
    with their scales), then finish the shard with the real code. The partial directory is
    removed, as a finished extract job leaves it, unless `keep_partial` (a job that has not
    yet verified its shard)."""
    plan = replace(plan, storage_dtype=storage_dtype)
    out_dir = Path(out_dir)
    tokens_path = out_dir / "tokens" / f"{shard.shard_id}.safetensors"
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    write_token_shard(shard, tokens_path)
    out = out_dir / fp / f"{shard.shard_id}.safetensors"
    chunks = ShardChunks.plan(shard, fp, out, chunk_tokens)
    shard_file = prepare_shard_file(chunks, plan, "bfloat16")
    g = torch.Generator().manual_seed(seed)
    for i in range(len(chunks.ranges)):
        lo, hi = chunks.token_range(i)
        hs = torch.randn(hi - lo, len(plan.layer_ids), plan.hidden_size, generator=g)
        hs = hs.to(torch.bfloat16)
        (target,) = chunk_targets(chunks, plan, shard_file, i).values()
        if is_fp8(storage_dtype):
            target.commit(*quantize(hs))
        else:
            target.commit(hs, None)
    size = finish_shard(chunks, out)
    if not keep_partial:
        shutil.rmtree(chunks.partial_dir)
    sha = file_sha256(out)
    record = {
        "shard_id": shard.shard_id,
        "fingerprint": fp,
        "sha256": sha,
        "bytes": size,
        "n_tokens": int(len(shard.input_ids)),
    }
    (out_dir / fp / f"{shard.shard_id}.json").write_text(json.dumps(record))
    return tokens_path, out, record
