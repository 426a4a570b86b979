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

from eagleflow.heldout import HELDOUT_MODULUS, heldout_prompts, split
from eagleflow.templating import tokenize_conversation


@dataclass
class TargetTrainConfig:
    steps: int = 300
    batch_tokens: int = 512
    lr: float = 6e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.05
    max_length: int = 256
    seed: int = 0
    heldout_modulus: int = HELDOUT_MODULUS
    sample_prompts: int = 6  # held-out prompts answered greedily after training, for the log


def _lr(cfg: TargetTrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _pad(batch, pad_id: int, multiple: int = 8):
    """(ids, labels) of a list of (ids, loss mask) samples, right-padded to a multiple of
    `multiple` tokens (few distinct shapes: CPU kernels are set up once per shape)."""
    n = -(-max(len(x) for x, _ in batch) // multiple) * multiple
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    for r, (x, m) in enumerate(batch):
        ids[r, : len(x)] = torch.as_tensor(x)
        lab = torch.as_tensor(x).clone()
        lab[torch.as_tensor(m) == 0] = -100
        labels[r, : len(x)] = lab
    return ids, labels


def _length_batches(indices, samples, batch_tokens: int) -> list[list[int]]:
    """`indices` sorted by sample length, cut into consecutive batches whose padded size
    (longest x count) stays within `batch_tokens` (a longer sample alone is a batch)."""
    batches, batch = [], []
    for i in sorted(indices, key=lambda i: len(samples[i][0])):
        if batch and len(samples[i][0]) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


def _batches(samples, batch_tokens: int, pad_id: int, generator, group: int = 64):
    """Endless seeded stream of padded batches (ids, labels) of at most about `batch_tokens`
    tokens, padding included. Length-grouped: each epoch is shuffled, cut into windows of
    about `group` batches, sorted by length inside a window and batched there, and the
    window's batches are shuffled; so a batch holds samples of similar length and little
    padding, while the order stays random (the bundled samples are 5-72 tokens long: plain
    random batches were about half padding)."""
    mean_len = sum(len(s[0]) for s in samples) / len(samples)
    window = max(1, int(group * batch_tokens / mean_len))
    while True:
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order), window):
            batches = _length_batches(order[start:start + window], samples, batch_tokens)
            for b in torch.randperm(len(batches), generator=generator).tolist():
                yield _pad([samples[i] for i in batches[b]], pad_id)


@torch.no_grad()
def mean_loss(model, samples, pad_id: int, batch_tokens: int = 2048) -> float:
    """Mean cross-entropy per loss-masked token over `samples` (ids, loss mask)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in _length_batches(range(len(samples)), samples, batch_tokens):
        ids, labels = _pad([samples[i] for i in batch], pad_id)
        logits = model(input_ids=ids, attention_mask=(ids != pad_id).long()).logits[:, :-1].float()
        target = labels[:, 1:]
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                         ignore_index=-100, reduction="sum"))
        count += int((target != -100).sum())
    model.train(was_training)
    return total / max(1, count)


def train_target(base_dir, conversations, out_dir, cfg: TargetTrainConfig, log=print) -> dict:
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    torch.manual_seed(cfg.seed)
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    tok = AutoTokenizer.from_pretrained(base_dir)
    train_convs, held = split(conversations, cfg.heldout_modulus)

    def tokenized(convs):
        out = []
        for c in convs:
            t = tokenize_conversation(tok, c.messages, cfg.max_length)
            out.append((t.input_ids.tolist(), t.loss_mask.tolist()))
        return out

    samples, held_samples = tokenized(train_convs), tokenized(held)
    model = DeepseekV3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    heldout_before = mean_loss(model, held_samples, tok.pad_token_id) if held_samples else None
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    stream = _batches(samples, cfg.batch_tokens, tok.pad_token_id, gen)
    t0, losses, real_tokens, padded_tokens = time.time(), [], 0, 0
    every = max(10, cfg.steps // 20)
    for step in range(cfg.steps):
        ids, labels = next(stream)
        real_tokens += int((ids != tok.pad_token_id).sum())
        padded_tokens += ids.numel()
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        out = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
        if step % every == 0 or step + 1 == cfg.steps:
            log(f"step {step + 1}/{cfg.steps} loss {losses[-1]:.4f} lr {_lr(cfg, step):.2e} "
                f"({time.time() - t0:.0f}s)")
    seconds = time.time() - t0
    model.eval()
    heldout_after = mean_loss(model, held_samples, tok.pad_token_id) if held_samples else None
    log(f"held-out loss (assistant tokens, {len(held)} conversations): {heldout_before} -> {heldout_after}")
    samples_out = []
    if held:
        prompts = heldout_prompts(held, cfg.heldout_modulus, limit=cfg.sample_prompts)
        replies = _greedy(model, tok, [p["messages"] for p in prompts], max_new_tokens=32)
        for p, reply in zip(prompts, replies):
            samples_out.append({"prompt": p["messages"][-1]["content"], "greedy": reply,
                                "dataset": p["reference"]})
            log(f"greedy: {p['messages'][-1]['content']!r} -> {reply!r} (dataset: {p['reference']!r})")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    summary = {"train_config": asdict(cfg), "train_conversations": len(train_convs),
               "heldout_conversations": len(held), "seconds": round(seconds, 1),
               "epochs": round(real_tokens / sum(len(x) for x, _ in samples), 2),
               "padding_fraction": round(1 - real_tokens / max(1, padded_tokens), 3),
               "first_loss": losses[0], "last_loss": sum(losses[-10:]) / min(10, len(losses)),
               "heldout_loss_before": heldout_before, "heldout_loss_after": heldout_after,
               "greedy_heldout_samples": samples_out}
    (tmp / "train_summary.json").write_text(json.dumps(summary, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return summary


def _greedy(model, tok, prompts, max_new_tokens: int) -> list[str]:
    out = []
    for messages in prompts:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(gen[0, len(ids):], skip_special_tokens=True))
    return out


@torch.no_grad()
def greedy_completions(target_dir, prompts, max_new_tokens: int = 24) -> list[str]:
    """Greedy assistant replies (transformers, no cache tricks) for chat prompts."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return _greedy(model, tok, prompts, max_new_tokens)
