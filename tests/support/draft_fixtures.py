"""A tiny target (config, embedding, norm, lm_head) and synthetic extracted shards for the
draft's tests: seconds on a CPU, no vLLM."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagleflow.store.quant import FP8, SCALES_KEY, quantize

H, V, L = 32, 64, 4  # tiny target: hidden, vocab, layers
LAYER_IDS = [1, 2, 3, L]
# DraftConfig overrides that keep the draft tiny (heads of 8 over hidden 32)
# The names of a one-layer draft's speculators checkpoint, which vLLM 0.32's
# Eagle3LlamaForCausalLM.load_weights accepts (`model.` prepended, q/k/v and gate/up stacked).
SPECULATORS_NAMES = {
    "embed_tokens.weight",
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}

TINY_DRAFT = dict(intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# The MLA draft (`draft.architecture: mla`) over the tiny target, which has no MLA: every shape
# key given. q.k over 8 + 8 dims, v 12.
TINY_MLA_DRAFT = dict(
    decoder="mla",
    intermediate_size=48,
    num_attention_heads=4,
    q_lora_rank=16,
    kv_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


def write_target(d: Path, seed=0) -> Path:
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "vocab_size": V,
        "num_hidden_layers": L,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
    }
    (d / "config.json").write_text(json.dumps(config))
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(V, H, generator=g).bfloat16(),
            "model.norm.weight": (1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
            "lm_head.weight": torch.randn(V, H, generator=g).bfloat16(),
            "model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2).bfloat16(),  # never read
        },
        str(d / "model.safetensors"),
    )
    return d


def write_shard(
    path: Path,
    n_samples: int,
    seed: int,
    layer_ids=LAYER_IDS,
    vocab_hi=V,
    storage_dtype=None,
    lengths=None,
):
    """A shard whose final state is a function of the next token (so there is something to
    learn); `storage_dtype` float8_e4m3fn stores it quantized, with its scales; `lengths`
    fixes the samples' lengths (else 6 to 13 tokens each)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(6, 14, (n_samples,), generator=g)
    else:
        lengths = torch.tensor(lengths)
        n_samples = len(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offsets[-1])
    ids = torch.randint(0, vocab_hi, (n,), generator=g)
    mask = (torch.rand(n, generator=g) < 0.7).to(torch.uint8)
    table = torch.randn(V, len(layer_ids), H, generator=torch.Generator().manual_seed(99))
    hidden = table[ids] + 0.05 * torch.randn(n, len(layer_ids), H, generator=g)
    states = {"hidden_states": hidden.bfloat16()}
    if storage_dtype == FP8:
        states["hidden_states"], states[SCALES_KEY] = quantize(states["hidden_states"])
    save_file(
        {
            **states,
            "input_ids": ids,
            "loss_mask": mask,
            "offsets": offsets,
        },
        str(path),
        metadata={
            "layer_ids": json.dumps(layer_ids),
            "layer_id_convention": "vllm",
            "format": "eagleflow-hidden-v1",
            "fingerprint": "0" * 16,
            "sample_ids": json.dumps([f"s{seed}-{i}" for i in range(n_samples)]),
            **({"storage_dtype": storage_dtype} if storage_dtype else {}),
        },
    )
    return path


def vllm_reference_drafts(script: str, work: Path, aux, tokens, export_dirs) -> list:
    """Runs `tests/support/<script>` (vLLM's own EAGLE-3 module on each export, drafting as its
    proposer does) in a process of its own, as vLLM's distributed state is process-global, and
    returns its results, one per export."""
    repo = Path(__file__).resolve().parents[2]
    torch.save(
        {"aux": aux, "tokens": tokens, "target_layers": L, "target_vocab": V}, work / "inputs.pt"
    )
    proc = subprocess.run(
        [sys.executable, str(repo / "tests" / "support" / script), str(work / "inputs.pt"),
         str(work / "out.pt"), *map(str, export_dirs)],
        env=dict(os.environ, PYTHONPATH=str(repo / "workflow")),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(work / "out.pt")
