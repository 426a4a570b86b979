"""Extracted shards made without vLLM (random states through the real chunk/assemble path),
for tests of verification, integrity and caching."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagleflow.data.conversations import Conversation
from eagleflow.data.shards import build_shards, write_token_shard
from eagleflow.data.templating import tokenize_conversation, tokenizer_digest
from eagleflow.extract.shard import assemble_shard, chunk_path, chunk_ranges
from eagleflow.fixtures.bundled_data import generate_conversations

PLAN = {"layer_ids": [2, 4, 5, 8], "strategy": "aux_layers", "hidden_size": 16}
FP = "0123456789abcdef"


def make_token_shards(tokenizer, n=8, size=4, seed=0):
    convs = [
        Conversation(r["id"], tuple(r["messages"]), "f", i)
        for i, r in enumerate(generate_conversations(n, seed))
    ]
    toks = [tokenize_conversation(tokenizer, c.messages, 512) for c in convs]
    return build_shards(convs, toks, size, tokenizer_digest(tokenizer))


def make_extracted_shard(shard, out_dir: Path, fp=FP, plan=PLAN, chunk_tokens=64, seed=0):
    """Write chunk files as the worker would, then assemble them with the real code."""
    out_dir = Path(out_dir)
    tokens_path = out_dir / "tokens" / f"{shard.shard_id}.safetensors"
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    write_token_shard(shard, tokens_path)
    partial = out_dir / fp / ".partial" / shard.shard_id
    partial.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i, (a, b) in enumerate(chunk_ranges(shard.offsets, chunk_tokens)):
        ids = torch.from_numpy(shard.input_ids[shard.offsets[a] : shard.offsets[b]])
        hs = torch.randn(len(ids), len(plan["layer_ids"]), plan["hidden_size"], generator=g).to(
            torch.bfloat16
        )
        meta = {"fingerprint": fp, "shard_id": shard.shard_id, "chunk": i, "samples": [a, b]}
        save_file(
            {"hidden_states": hs, "input_ids": ids},
            str(chunk_path(partial, i)),
            metadata={k: json.dumps(v) for k, v in meta.items()},
        )
    out = out_dir / fp / f"{shard.shard_id}.safetensors"
    sha, size = assemble_shard(
        shard, chunk_ranges(shard.offsets, chunk_tokens), partial, plan, fp, out
    )
    record = {
        "shard_id": shard.shard_id,
        "fingerprint": fp,
        "sha256": sha,
        "bytes": size,
        "n_tokens": int(len(shard.input_ids)),
    }
    (out_dir / fp / f"{shard.shard_id}.json").write_text(json.dumps(record))
    return tokens_path, out, record
