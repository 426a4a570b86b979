"""Compact EAGLE-3 draft trainer with training-time test (TTT).

loss = sum_k  step_weight**k * KL(target_k || draft_k)   over loss-masked anchors, where
target_k is the target's own distribution at position t+1+k (its final norm and lm_head
applied to the stored final pre-norm state, restricted to the draft vocabulary) and draft_k
the draft's after k unrolled steps (`Eagle3Draft.ttt_forward`).

One pack of consecutive samples per step and rank (`draft_data`), streamed from the
memory-mapped shards. Writes to `out_dir`:
  checkpoint.pt   latest state (model, optimizer, step), replaced atomically every
                  `ckpt_every` steps and at the end; a rerun resumes from it
  metrics.csv     one row per step: loss, per-TTT-step loss, accuracy (top-1 agreement with
                  the target) and conditional accuracy (given steps < k all agreed)
  curves.png      the same, plotted
Deterministic from `seed` (model init and data order); resuming gives the same weights as
an uninterrupted run. Under torchrun (WORLD_SIZE > 1) it wraps the draft in
DistributedDataParallel and each rank reads its own packs; rank 0 writes.
"""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from eagleflow.data.heldout import HELDOUT_MODULUS, excluder
from eagleflow.draft.data import load_pack, make_packs, pack_for, read_layout
from eagleflow.draft.model import DraftConfig, Eagle3Draft
from eagleflow.draft.vocab import DraftVocab
from eagleflow.target.head import EMBED, TargetHead, read_target_config, read_target_tensor

CHECKPOINT, METRICS, CURVES = "checkpoint.pt", "metrics.csv", "curves.png"


@dataclass
class TrainConfig:
    steps: int = 2000
    ttt_steps: int = 3
    step_weight: float = 0.8  # loss weight of TTT step k: step_weight**k
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_tokens: int = 2048  # tokens per pack (one pack per step and rank)
    ckpt_every: int = 200
    seed: int = 0
    device: str = "auto"
    heldout_modulus: int = HELDOUT_MODULUS  # held-out samples (eagleflow.data.heldout) are skipped


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine down to min_lr_ratio * lr (a function of the step only)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


@dataclass
class StepStats:
    """Sums over the anchors of one TTT step (added over batches, all-reduced over ranks)."""

    kl: float = 0.0
    tokens: int = 0
    correct: int = 0  # draft top-1 == target top-1
    cond_correct: int = 0  # correct where every earlier step was correct too
    cond_tokens: int = 0  # anchors where every earlier step was correct

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def metrics(self, k: int) -> dict:
        return {
            f"loss_{k}": self.kl / max(self.tokens, 1),
            f"acc_{k}": self.correct / max(self.tokens, 1),
            f"cond_acc_{k}": self.cond_correct / max(self.cond_tokens, 1),
        }


def all_reduce_stats(stats: list[StepStats], device) -> list[StepStats]:
    """The per-step sums of every rank (one collective for all steps)."""
    flat = torch.tensor([astuple(s) for s in stats], dtype=torch.float64, device=device)
    dist.all_reduce(flat)
    return [
        StepStats(kl, int(n), int(ok), int(cok), int(cn))
        for kl, n, ok, cok, cn in flat.cpu().tolist()
    ]


def ttt_loss(logits: list, target_logits: torch.Tensor, batch, step_weight: float):
    """Weighted KL over the TTT steps, and each step's `StepStats`."""
    total = logits[0].new_zeros(())
    stats = []
    target_logp = F.log_softmax(target_logits, dim=-1)
    prev_ok = batch.valid[0].clone()
    for k, step_logits in enumerate(logits):
        valid = batch.valid[k]
        n = int(valid.sum())
        tgt = target_logp[batch.target_index[k][valid]]
        logq = F.log_softmax(step_logits[valid].float(), dim=-1)
        kl = (tgt.exp() * (tgt - logq)).sum(-1)
        loss_k = kl.mean() if n else kl.sum()
        total = total + step_weight**k * loss_k
        correct = torch.zeros_like(valid)
        correct[valid] = logq.argmax(-1) == tgt.argmax(-1)
        cond = prev_ok & valid
        stats.append(
            StepStats(
                kl=float(kl.detach().sum()),
                tokens=n,
                correct=int(correct.sum()),
                cond_correct=int((correct & cond).sum()),
                cond_tokens=int(cond.sum()),
            )
        )
        prev_ok = prev_ok & correct
    return total, stats


def _distributed():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank() if world > 1 else 0
    return rank, world


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _columns(ttt_steps: int) -> list[str]:
    cols = ["step", "lr", "loss", "tokens"]
    for k in range(ttt_steps):
        cols += [f"loss_{k}", f"acc_{k}", f"cond_acc_{k}"]
    return cols + ["elapsed_s"]


def _read_rows(path: Path, up_to_step: int) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= up_to_step]


def _write_rows(path: Path, columns, rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def plot_curves(rows: list[dict], ttt_steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [float(r["loss"]) for r in rows], label="weighted total", color="black")
    for k in range(ttt_steps):
        ax_loss.plot(steps, [float(r[f"loss_{k}"]) for r in rows], label=f"TTT step {k}", alpha=0.7)
        ax_acc.plot(steps, [float(r[f"acc_{k}"]) for r in rows], label=f"TTT step {k}", alpha=0.7)
    ax_loss.set(xlabel="training step", ylabel="KL(target || draft)", yscale="log", title="loss")
    ax_acc.set(
        xlabel="training step",
        ylabel="top-1 agreement with the target",
        ylim=(0, 1),
        title="accuracy per TTT step",
    )
    ax_loss.legend()
    ax_acc.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def build_draft(target_dir, vocab: DraftVocab, num_aux: int, seed: int, **draft_overrides):
    """A fresh draft (seeded init) with the target's embedding and the vocab maps."""
    config = read_target_config(target_dir)
    cfg = DraftConfig.for_target(config, vocab.size, num_aux, **draft_overrides)
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.set_vocab(vocab.d2t, vocab.t2d)
    model.set_embedding(read_target_tensor(target_dir, EMBED).float())
    return model


def optimizer_step(
    model, head, params, optim, cfg: TrainConfig, batch, step: int, device: torch.device
):
    """One training step (learning rate of `step`, bf16 autocast on CUDA, TTT loss, clipped
    update); returns (loss, per-TTT-step stats)."""
    for group in optim.param_groups:
        group["lr"] = lr_at(cfg, step)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(batch.aux, batch.tokens, batch.positions, batch.doc, cfg.ttt_steps)
    loss, stats = ttt_loss(logits, head(batch.final), batch, cfg.step_weight)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optim.step()
    return loss, stats


def training_recipe(cfg: TrainConfig, draft_config: dict, layout, vocab: DraftVocab, world: int):
    """Everything that decides the trained weights: a checkpoint is resumed only when all of
    it is unchanged (not how often checkpoints are written, nor on which device)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("ckpt_every", "device")}
    return {
        "train_config": settings,
        "draft_config": draft_config,
        "shards": [Path(p).name for p in layout.paths],  # content-addressed names
        "layer_ids": list(layout.layer_ids),
        "vocab": vocab.summary(),
        "world_size": world,
    }


def train(
    shards,
    target_dir,
    vocab: DraftVocab,
    out_dir,
    cfg: TrainConfig,
    draft_overrides: dict | None = None,
    stop_after: int | None = None,
) -> dict:
    """Train (or resume) and return a summary; `stop_after` ends early as a crash would."""
    rank, world = _distributed()
    device = _device(cfg)
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    target_config = read_target_config(target_dir)
    layout = read_layout(sorted(str(p) for p in shards), int(target_config["num_hidden_layers"]))
    packs = make_packs(layout.paths, cfg.max_tokens, excluder(cfg.heldout_modulus))
    if not packs:
        raise ValueError(f"no training samples in {layout.paths} outside the held-out split")
    model = build_draft(target_dir, vocab, len(layout.aux_ids), cfg.seed, **(draft_overrides or {}))
    head = TargetHead.load(target_dir, vocab.target_ids)
    model.to(device)
    head.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    start = 0
    ckpt_path = out / CHECKPOINT
    recipe = training_recipe(cfg, model.cfg.to_dict(), layout, vocab, world)
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        changed = sorted(k for k in recipe if ckpt.get("recipe", {}).get(k) != recipe[k])
        if changed:
            # Another run's checkpoint (a changed seed, lr, shard set...): resuming it would
            # export a draft that is not this configuration's. Start over.
            if rank == 0:
                print(
                    f"{ckpt_path}: written for another training run ({', '.join(changed)} "
                    "differ); training from step 0"
                )
        else:
            model.load_state_dict(ckpt["model"])
            optim.load_state_dict(ckpt["optimizer"])
            start = ckpt["step"]
    columns = _columns(cfg.ttt_steps)
    rows = _read_rows(out / METRICS, start) if rank == 0 else []
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    def checkpoint(step):
        if rank == 0:
            _atomic_save(
                {
                    "step": step,
                    "model": model.state_dict(),
                    "optimizer": optim.state_dict(),
                    "draft_config": model.cfg.to_dict(),
                    "train_config": asdict(cfg),
                    "recipe": recipe,
                    "layer_ids": layout.layer_ids,
                    "aux_ids": layout.aux_ids,
                    "target": str(target_dir),
                    "vocab": vocab.summary(),
                },
                ckpt_path,
            )
            _write_rows(out / METRICS, columns, rows)
            plot_curves(rows, cfg.ttt_steps, out / CURVES)
        if world > 1:
            dist.barrier()

    t0 = time.time()
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = tqdm(total=cfg.steps, initial=start, disable=rank != 0, desc="train draft", mininterval=2)
    for step in range(start, end):
        batch = load_pack(layout, pack_for(packs, cfg.seed, step * world + rank), cfg.ttt_steps).to(
            device
        )
        loss, stats = optimizer_step(ddp, head, params, optim, cfg, batch, step, device)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
            stats = all_reduce_stats(stats, device)
        row = {
            "step": step + 1,
            "lr": f"{lr_at(cfg, step):.3e}",
            "loss": f"{loss.item():.6f}",
            "tokens": stats[0].tokens,
            "elapsed_s": f"{time.time() - t0:.2f}",
        }
        for k, s in enumerate(stats):
            m = s.metrics(k)
            row[f"loss_{k}"] = f"{m[f'loss_{k}']:.6f}"
            row[f"acc_{k}"] = f"{m[f'acc_{k}']:.4f}"
            row[f"cond_acc_{k}"] = f"{m[f'cond_acc_{k}']:.4f}"
        rows.append(row)
        bar.update(1)
        bar.set_postfix(loss=row["loss"], acc0=row["acc_0"])
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps:
            checkpoint(step + 1)
    bar.close()
    return {
        "start_step": start,
        "end_step": end,
        "seconds": time.time() - t0,
        "packs": len(packs),
        "heldout_modulus": cfg.heldout_modulus,
        "world_size": world,
        "last": rows[-1] if rows else None,
    }


def load_trained(path, map_location="cpu"):
    """(draft, checkpoint dict) from a checkpoint file or a trainer's output directory."""
    path = Path(path)
    ckpt = torch.load(
        path / CHECKPOINT if path.is_dir() else path, map_location=map_location, weights_only=False
    )
    model = Eagle3Draft(DraftConfig(**ckpt["draft_config"]))
    model.load_state_dict(ckpt["model"])
    return model, ckpt


@torch.no_grad()
def evaluate_draft(
    model: Eagle3Draft,
    shards,
    target_dir,
    vocab: DraftVocab,
    ttt_steps: int = 3,
    max_tokens: int = 2048,
) -> dict:
    """Per-TTT-step KL and top-1 agreement with the target over every pack of `shards`."""
    target_config = read_target_config(target_dir)
    layout = read_layout(sorted(str(p) for p in shards), int(target_config["num_hidden_layers"]))
    head = TargetHead.load(target_dir, vocab.target_ids)
    sums = [StepStats() for _ in range(ttt_steps)]
    model.eval()
    for pack in make_packs(layout.paths, max_tokens):
        batch = load_pack(layout, pack, ttt_steps)
        logits = model(batch.aux, batch.tokens, batch.positions, batch.doc, ttt_steps)
        _, stats = ttt_loss(logits, head(batch.final), batch, 1.0)
        sums = [a + b for a, b in zip(sums, stats)]
    out = {}
    for k, s in enumerate(sums):
        out |= s.metrics(k) | {f"tokens_{k}": s.tokens}
    # expected tokens per target step if drafts were accepted while they agree (greedy)
    run, length = 1.0, 1.0
    for k in range(ttt_steps):
        run *= out[f"cond_acc_{k}"]
        length += run
    out["estimated_acceptance_length"] = length
    return out


def main(argv=None):
    """CLI, also under torchrun: `torchrun --nproc_per_node 8 -m eagleflow.draft.train ...`."""
    import argparse
    import json

    from eagleflow.draft.vocab import load_vocab

    p = argparse.ArgumentParser(description="Train an EAGLE-3 draft on extracted shards.")
    p.add_argument("--shards", nargs="+", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--vocab", required=True, help="vocab.safetensors from draft_vocab")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="{}", help="TrainConfig fields as JSON")
    a = p.parse_args(argv)
    summary = train(
        a.shards, a.target, load_vocab(a.vocab), a.out, TrainConfig(**json.loads(a.config))
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
