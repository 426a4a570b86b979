"""Validation: the held-out packs' figures (`objective.figures`: the training objective, the
KL apart, accuracies and the simulated acceptance length), over every rank's packs. The
trainer calls it every `eval_every` steps and at the end; what is kept of it is the
checkpoint module's (`Checkpoints.offer_best`), what is written the records'."""

from __future__ import annotations

import time

import torch

from eagleflow.train.objective import FIGURES, TOKENS, figures
from eagleflow.train.parallel import all_reduce
from eagleflow.train.step import StepContext, pack_loss


@torch.no_grad()
def evaluate(model, head, loader, ctx: StepContext, beat=lambda: None) -> dict | None:
    """The figures of the held-out packs of every rank (None without any); `beat()` after
    each pack (the stall watchdog's sign of progress)."""
    model.eval()
    sums = torch.zeros(ctx.cfg.ttt_steps, len(FIGURES), dtype=torch.float64, device=ctx.device)
    for batch in loader:
        beat()
        _, pack = pack_loss(model, head, batch.to(ctx.device, non_blocking=True), ctx)
        sums += pack
    model.train()
    sums = all_reduce(sums)
    return figures(sums, ctx.cfg.step_weight) if sums[0, TOKENS] else None


class Validator:
    """Runs `evaluate` on the run's held-out loader under the watchdog, timing it."""

    def __init__(self, model, head, loader, ctx: StepContext, watchdog):
        self.model, self.head, self.loader, self.ctx = model, head, loader, ctx
        self.watchdog = watchdog
        self.seconds = 0.0

    def __call__(self, step: int) -> dict | None:
        t = time.perf_counter()
        with self.watchdog.waiting(f"the validation at step {step} (held-out packs, all-reduce)"):
            metrics = evaluate(self.model, self.head, self.loader, self.ctx, self.watchdog.beat)
        self.seconds += time.perf_counter() - t
        return metrics
