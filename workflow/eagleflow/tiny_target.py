"""The embedded default target: a tiny DeepseekV3ForCausalLM with the real architecture.

MLA with the latent size real DeepSeek-V3 / Kimi-K2 use (kv_lora_rank 512 + qk_rope 64 =
576, the only size vLLM's CPU MLA kernel accepts), MoE with routed and shared experts
routed like Kimi-K2 (`noaux_tc`, `sigmoid`), bf16 safetensors, deterministic from a seed,
and a byte-level BPE tokenizer trained on the bundled corpus with a chat template that marks
assistant text for transformers' assistant masks.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

# `{% generation %}` marks what `return_assistant_tokens_mask` reports as assistant tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_TARGET_FILES = ("config.json", "model.safetensors", *TINY_TOKENIZER_FILES)

TINY_ARCH = dict(
    num_hidden_layers=8,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, tokenizer, **overrides):
    from transformers import DeepseekV3Config

    arch = {**TINY_ARCH, **overrides}
    config = DeepseekV3Config(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    # vLLM creates `gate.e_score_correction_bias` (which HF saves) only for noaux_tc.
    config.topk_method = "noaux_tc"
    config.scoring_func = "sigmoid"
    return config


def build_tiny_target(corpus_texts: list[str], out_dir: str | Path, seed: int = 0,
                      vocab_size: int = 1024, **arch_overrides) -> Path:
    from transformers import DeepseekV3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_texts, vocab_size)
    config = tiny_config(len(tokenizer), tokenizer, **arch_overrides)
    return _save_seeded(DeepseekV3ForCausalLM, config, tokenizer, out_dir, seed)


def build_tiny_llama_target(corpus_texts: list[str], out_dir: str | Path, seed: int = 0,
                            vocab_size: int = 1024) -> Path:
    """A tiny dense LlamaForCausalLM with the same tokenizer: proves the capture path is not
    DeepSeek-only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_texts, vocab_size)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    return _save_seeded(LlamaForCausalLM, config, tokenizer, out_dir, seed)


def build_tiny_qwen3_target(corpus_texts: list[str], out_dir: str | Path, seed: int = 0,
                            vocab_size: int = 1024) -> Path:
    """A tiny dense Qwen3ForCausalLM (grouped-query attention with per-head q/k RMSNorm, explicit
    head_dim) with the same tokenizer: the second dense family through the same capture path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_texts, vocab_size)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    config.architectures = ["Qwen3ForCausalLM"]
    return _save_seeded(Qwen3ForCausalLM, config, tokenizer, out_dir, seed)


def _save_seeded(model_cls, config, tokenizer, out_dir: Path, seed: int) -> Path:
    """Initialise `model_cls(config)` from `seed`, save it in bf16 safetensors with the tokenizer."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    config.dtype = "bfloat16"
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def corpus_texts(conversations) -> list[str]:
    return [m["content"] for c in conversations for m in c.messages]


def describe(out_dir: str | Path) -> dict:
    cfg = json.loads((Path(out_dir) / "config.json").read_text())
    return {k: cfg.get(k) for k in ("architectures", "num_hidden_layers", "hidden_size", "vocab_size")}
