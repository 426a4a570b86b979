"""One optimizer step, and the loss of one pack: what the trainer and validation run.

A global batch of `batch_packs` packs is split over the ranks and each rank's micro-steps
(`eagleflow.train.data.RankSampler`). Its objective is per token over the whole batch
(`eagleflow.train.objective`): before the forward, the anchors each TTT step trains are
counted over this rank's packs (on the host: the counts came with the packs) and summed over
the ranks, one small all-reduce; each pack's objective is then divided by those counts, so the
packs' objectives add up to the batch's. FSDP averages the gradients over the W ranks, so
each rank backpropagates W times its share; the update is the gradient of the batch's
objective, whatever the world size, the micro-steps or the padding packs (which hold no
anchor). Under sequence splitting a pack's slices each add their anchors' part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleflow.train.objective import add_noise, noise_generator, ttt_loss
from eagleflow.train.parallel import Parallelism, all_reduce


@dataclass(frozen=True)
class StepContext:
    """What a pack's loss needs besides the model and the pack."""

    cfg: object  # TrainConfig
    parallel: Parallelism
    split: object = None  # SequenceSplit of this rank, None without sequence splitting

    @property
    def device(self) -> torch.device:
        return self.parallel.device

    @property
    def part(self) -> int:
        return self.split.part if self.split is not None else 0


@dataclass
class StepResult:
    """This rank's part of one optimizer step (figures still on the device)."""

    sums: torch.Tensor  # [ttt_steps, FIGURES] summed over this rank's packs
    packs: int  # real packs, each counted by its first slice
    grad_norm: float


def pack_loss(model, head, batch, ctx: StepContext, tokens=None, step: int = 0):
    """(objective, figures) of one pack, or of this rank's slice of it; `tokens` [steps]: the
    counts it is averaged over (the pack's own by default). In training with `noise_std` the
    aux states get the noise of this pack and step (`objective.noise_generator`)."""
    cfg, device = ctx.cfg, ctx.device
    aux, final = batch.values(torch.bfloat16 if device.type == "cuda" else torch.float32)
    if model.training and cfg.noise_std:
        generator = noise_generator(cfg.seed, step, batch.key, ctx.part, device)
        aux = add_noise(aux, final.shape[-1], cfg.noise_std, generator)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=ctx.parallel.autocast):
        logits = model(aux, batch.tokens, batch.positions, batch.doc, cfg.ttt_steps, ctx.split)
    return ttt_loss(logits, head(final), batch, cfg.step_weight, cfg.loss, tokens)


def global_tokens(batches, ctx: StepContext) -> torch.Tensor:
    """[ttt_steps] anchors the global batch trains at each TTT step: this rank's packs (a
    pack counted by its first slice) summed over the ranks."""
    counts = torch.zeros(ctx.cfg.ttt_steps, dtype=torch.float64)
    if ctx.part == 0:
        for batch in batches:
            counts += batch.step_tokens.to(torch.float64)
    return all_reduce(counts.to(ctx.device))


def train_step(model, head, optims, batches: list, ctx: StepContext, step: int = 0):
    """One optimizer step over this rank's packs of global step `step` (module doc); the
    packs move to the device one at a time."""
    tokens = global_tokens(batches, ctx).to(ctx.device, torch.float32)
    sums = torch.zeros(ctx.cfg.ttt_steps, 6, dtype=torch.float64, device=ctx.device)
    packs = 0
    for batch in batches:
        batch = batch.to(ctx.device, non_blocking=True)
        loss, figures = pack_loss(model, head, batch, ctx, tokens, step)
        (loss * ctx.parallel.world).backward()
        sums += figures
        packs += batch.samples > 0
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, ctx.cfg.grad_clip or float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    for optim in optims:
        optim.step()
        optim.zero_grad(set_to_none=True)
    return StepResult(sums, int(packs), float(norm))
