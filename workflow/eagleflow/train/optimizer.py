"""The draft's optimizers: AdamW over every trainable weight, or Muon over the hidden 2D
matrices and AdamW over the rest, as speculators 0.9 (`train/optimizers.py`, its default).

Muon orthogonalizes a whole matrix's update (Newton-Schulz). Under FSDP2 a weight is a DTensor
sharded by rows, and `torch.optim.Muon`'s matrix products and norms are DTensor ops, so they
run on the whole matrix (the ranks exchange the shards), not on each rank's rows; the
two-rank test checks that against one rank. Embeddings and the lm_head stay with AdamW
(Keller Jordan's Muon; speculators alike): their rows are tokens, not directions.
`torch.optim.Muon` orthogonalizes in bf16; `Muon` here does so on CUDA too, and in float32 on a
CPU, where a bf16 matrix product without native bf16 units runs about 60x slower than float32
(docs/measurements/muon-on-cpu.md).

Every param group keeps its peak learning rate in `peak_lr`; the schedule (`lr_factor`: a
linear warm-up, then cosine to `min_lr_ratio`) scales it (`set_lr`), so Muon's and AdamW's
peaks follow one warm-up and decay.
"""

from __future__ import annotations

import math

import torch

ADAMW_NAMES = ("embed_tokens", "lm_head")  # 2D, yet AdamW under Muon


def muon_split(model) -> tuple[list, list]:
    """(Muon's, AdamW's) trainable parameters: Muon takes 2D matrices of at least 2 x 2 whose
    names are not an embedding's or the lm_head's."""
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim == 2 and min(param.shape) > 1
        (muon if matrix and not any(n in name for n in ADAMW_NAMES) else adamw).append(param)
    return muon, adamw


def build_optimizers(model, cfg) -> list[torch.optim.Optimizer]:
    """The optimizers `cfg.optimizer` names (TrainConfig checked the name), stepped together
    by the trainer."""
    if cfg.optimizer == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        optims = [torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)]
    else:
        muon, adamw = muon_split(model)
        optims = []
        if muon:
            optims.append(Muon(muon, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay))
        if adamw:
            optims.append(torch.optim.AdamW(adamw, lr=cfg.lr, weight_decay=cfg.weight_decay))
    for optim in optims:
        for group in optim.param_groups:
            group["peak_lr"] = group["lr"]
    return optims


def newton_schulz_dtype(device: torch.device) -> torch.dtype:
    """bf16 where matrix products have bf16 units (CUDA, as torch's Muon), float32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Muon(torch.optim.Muon):
    """`torch.optim.Muon`'s step (Nesterov momentum, five quintic Newton-Schulz iterations,
    the original lr adjustment, decoupled weight decay) with the iterations in
    `newton_schulz_dtype` of the weight's device. Its state is torch's (`momentum_buffer`), so
    either resumes the other's checkpoint."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(
                    update,
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                    newton_schulz_dtype(param.device),
                )
                rows, cols = param.shape
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-lr * math.sqrt(max(1, rows / cols)))
        return loss


def orthogonalize(grad, coefficients, steps: int, eps: float, dtype: torch.dtype):
    """torch's `_zeropower_via_newtonschulz` in `dtype`: the quintic iteration that maps a
    matrix to about its nearest semi-orthogonal one (singular values near 1)."""
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def set_lr(optims, factor: float) -> None:
    """Every group's learning rate: its peak times the schedule's `factor`."""
    for optim in optims:
        for group in optim.param_groups:
            group["lr"] = group["peak_lr"] * factor


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine down to min_ratio (of the peak lr)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
