"""Briefly train the embedded tiny target on the bundled corpus, so its greedy outputs mean
something (a random target's near-flat distributions make acceptance length meaningless).

transformers' `DeepseekV3ForCausalLM`, loaded from the untrained embedded target (same
tokenizer, config and architecture), trained in fp32 with AdamW on the bundled chat data
rendered with the target's chat template, loss on assistant tokens only (the template's
`{% generation %}` mask), held-out conversations (`eagleflow.heldout`) excluded. Saved as
bf16 safetensors with the tokenizer files, like the untrained one. Deterministic from the
seed (init is the untrained target; data order from a seeded generator; one torch thread
count per run).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagleflow.heldout import HELDOUT_MODULUS, split
from eagleflow.templating import tokenize_conversation


@dataclass
class TargetTrainConfig:
    steps: int = 40
    batch_tokens: int = 512
    lr: float = 6e-3
    warmup_steps: int = 5
    min_lr_ratio: float = 0.05
    max_length: int = 256
    seed: int = 0
    heldout_modulus: int = HELDOUT_MODULUS


def _lr(cfg: TargetTrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _batches(samples, batch_tokens: int, pad_id: int, generator):
    """Endless seeded stream of padded batches (ids, labels) of about `batch_tokens` tokens."""
    while True:
        order = torch.randperm(len(samples), generator=generator).tolist()
        batch = []
        for i in order:
            batch.append(samples[i])
            longest = max(len(s[0]) for s in batch)
            if longest * (len(batch) + 1) > batch_tokens:
                n = max(len(s[0]) for s in batch)
                ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
                labels = torch.full((len(batch), n), -100, dtype=torch.long)
                for r, (x, m) in enumerate(batch):
                    ids[r, : len(x)] = torch.as_tensor(x)
                    lab = torch.as_tensor(x).clone()
                    lab[torch.as_tensor(m) == 0] = -100
                    labels[r, : len(x)] = lab
                yield ids, labels
                batch = []


def train_target(base_dir, conversations, out_dir, cfg: TargetTrainConfig, log=print) -> dict:
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    torch.manual_seed(cfg.seed)
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    tok = AutoTokenizer.from_pretrained(base_dir)
    train_convs, held = split(conversations, cfg.heldout_modulus)
    samples = []
    for c in train_convs:
        t = tokenize_conversation(tok, c.messages, cfg.max_length)
        samples.append((t.input_ids.tolist(), t.loss_mask.tolist()))
    model = DeepseekV3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    stream = _batches(samples, cfg.batch_tokens, tok.pad_token_id, gen)
    t0, losses = time.time(), []
    for step in range(cfg.steps):
        ids, labels = next(stream)
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        out = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
        if step % 10 == 0 or step + 1 == cfg.steps:
            log(f"step {step + 1}/{cfg.steps} loss {losses[-1]:.4f} ({time.time() - t0:.0f}s)")
    seconds = time.time() - t0
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    summary = {"train_config": asdict(cfg), "train_conversations": len(train_convs),
               "heldout_conversations": len(held), "seconds": round(seconds, 1),
               "first_loss": losses[0], "last_loss": sum(losses[-10:]) / min(10, len(losses))}
    (tmp / "train_summary.json").write_text(json.dumps(summary, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return summary


@torch.no_grad()
def greedy_completions(target_dir, prompts, max_new_tokens: int = 24) -> list[str]:
    """Greedy assistant replies (transformers, no cache tricks) for chat prompts."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = []
    for messages in prompts:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, len(ids):], skip_special_tokens=True))
    return out
