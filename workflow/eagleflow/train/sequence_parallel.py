"""Sequence splitting: one pack trained by `parts` ranks, each holding a contiguous slice of
its anchors (`draft.sequence_parallel`), for samples whose pack does not fit one device.

Why it is cheap for EAGLE-3: of the draft's TTT forward, only the step-0 attention looks
across positions (each anchor sees the step-0 keys of its sample's causal prefix); the keys
TTT steps 1..k add are on the diagonal (each anchor its own), and the fc, MLP, head and loss
are per anchor. So a rank computes everything for its own anchors and needs only the other
ranks' step-0 keys and values: one all-gather of [kv_heads, N, head_dim] per pack and layer
(not per TTT step), whose backward sums the key gradients of every rank's queries
(reduce-scatter). No score tensor crosses ranks. At Kimi-K2.5's draft (8 kv heads x 128) and
a 20k-token pack that is 2 x 42 MB in bf16 per pack, against about 2 x 7,168 x 20k x 2 bytes =
573 MB of states each rank reads for its own anchors alone. (The all-gather of keys is the
"context parallel" of Llama 3's training; Ulysses would all-to-all every head's q/k/v and
output instead, for the same result.)

The pack is padded at its end to `parts * slice_length(n, parts)` anchors (padding anchors
are a sample of their own, trained on nothing), so every slice has the same length, a
multiple of the attention block: the flex `BlockMask` of a slice is the pack's, offset by
whole blocks. The pack plan does not depend on `parts`: the same packs, the same order, the
same loss as one rank training the whole pack (each slice's loss is divided by the pack's
token counts, `Batch.step_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagleflow.draft.model import BLOCK  # slices start on an attention block


def slice_length(n: int, parts: int) -> int:
    """Anchors per slice of an n-token pack: n itself in one part (no padding), else
    ceil(n / parts) rounded up to a whole attention block."""
    if parts == 1:
        return n
    per_part = -(-n // parts)
    return -(-per_part // BLOCK) * BLOCK


@dataclass
class SequenceSplit:
    """This rank's place in its sequence-parallel group: slice `part` of `parts`."""

    group: object  # torch.distributed ProcessGroup of the `parts` ranks sharing a pack
    part: int
    parts: int

    def offset(self, anchors: int) -> int:
        """First anchor of this slice in the pack (every slice has `anchors` anchors)."""
        return self.part * anchors

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [heads, n, d] of this slice -> [heads, parts * n, d] of the whole pack, in slice
        order; differentiable (its backward sums the gradient over the group)."""
        return _GatherSequence.apply(x, self)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 1); backward: reduce-scatter of the gradient, since
    every rank's queries read every slice's keys."""

    @staticmethod
    def forward(ctx, x, split: SequenceSplit):
        ctx.split = split
        local = x.transpose(0, 1).contiguous()  # [n, heads, d]: slices along dim 0
        out = local.new_empty((split.parts * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(out, local, group=split.group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        split = ctx.split
        whole = grad.transpose(0, 1).contiguous()
        mine = whole.new_empty((whole.shape[0] // split.parts, *whole.shape[1:]))
        dist.reduce_scatter_single(mine, whole, group=split.group)
        return mine.transpose(0, 1), None


def split_groups(world: int, parts: int, rank: int) -> SequenceSplit | None:
    """The groups of `parts` consecutive ranks (every rank creates every group, as
    `new_group` requires); this rank's split, or None when `parts` is 1."""
    if parts == 1:
        return None
    mine = None
    for first in range(0, world, parts):
        group = dist.new_group(list(range(first, first + parts)))
        if first <= rank < first + parts:
            mine = SequenceSplit(group, rank - first, parts)
    return mine
