"""Tiny dense targets (Llama, Qwen3) with the embedded tokenizer: the tests' proof that the
capture path is not DeepSeek-only. The workflow builds only the DeepseekV3 target."""

from __future__ import annotations

from pathlib import Path

from eagleflow.embedded.tiny_target import save_seeded, train_tokenizer

DENSE_ARCH = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def _build_dense(config_cls, model_cls, corpus_texts, out_dir, seed, vocab_size, **arch) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_texts, vocab_size)
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **DENSE_ARCH,
        **arch,
    )
    config.architectures = [model_cls.__name__]
    return save_seeded(model_cls, config, tokenizer, out_dir, seed)


def build_tiny_llama_target(
    corpus_texts: list[str], out_dir: str | Path, seed: int = 0, vocab_size: int = 1024
) -> Path:
    """A tiny dense LlamaForCausalLM with the same tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build_dense(LlamaConfig, LlamaForCausalLM, corpus_texts, out_dir, seed, vocab_size)


def build_tiny_qwen3_target(
    corpus_texts: list[str], out_dir: str | Path, seed: int = 0, vocab_size: int = 1024
) -> Path:
    """A tiny dense Qwen3ForCausalLM (grouped-query attention with per-head q/k RMSNorm, explicit
    head_dim): the second dense family through the same capture path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build_dense(
        Qwen3Config, Qwen3ForCausalLM, corpus_texts, out_dir, seed, vocab_size, head_dim=64
    )
