"""One pack's TTT loss, logits and gradients, with the pack whole (`pack_loss(parts=1)`) or
split over the ranks of a torchrun group (`python -m torch.distributed.run ... this file OUT
ATTENTION CHECKPOINTING [DECODER]`: rank 0 saves the slices' logits, the summed loss and the summed
gradients to OUT). Everything runs through the trainer's own code: `build_batch` slices the
pack, `ttt_loss` divides by the pack's token counts, the draft gathers its step-0 keys."""

import sys

import torch
import torch.distributed as dist

from eagleflow.draft.model import DraftConfig, Eagle3Draft
from eagleflow.train.data import ShardLayout, build_batch, slice_rows
from eagleflow.train.objective import ttt_loss
from eagleflow.train.sequence_parallel import split_groups

H, V, STEPS = 32, 40, 3
LENGTHS = [150, 40, 1, 109, 300]  # 600 tokens: across slice and block boundaries
LAYOUT = ShardLayout(paths=[], layer_ids=[1, 2, 3], final_id=3, aux_ids=[1, 2])


# The MLA draft's shape: per-head k of 8 + 4 dims, v of 6 (`decoder="mla"`).
MLA = dict(
    decoder="mla",
    num_key_value_heads=4,
    head_dim=12,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
)


def pack_loss(attention: str, checkpointing: bool, part=0, parts=1, split=None, decoder="llama"):
    """(loss, [logits per step], {name: grad}) of this slice; float64 throughout."""
    g = torch.Generator().manual_seed(0)
    n = sum(LENGTHS)
    ids = torch.randint(0, V, (n,), generator=g)
    mask = torch.rand(n, generator=g) < 0.8
    hidden = torch.randn(n, 3, H, generator=g, dtype=torch.float64)
    head = torch.randn(H, V, generator=g, dtype=torch.float64)
    starts = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0).tolist()
    shape = MLA if decoder == "mla" else dict(num_key_value_heads=2, head_dim=8)
    cfg = DraftConfig(
        **shape,
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        vocab_size=V,
        draft_vocab_size=V,
        num_aux=2,
        attention=attention,
        activation_checkpointing=checkpointing,
    )
    torch.manual_seed(1)
    model = Eagle3Draft(cfg)
    model.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    model.set_embedding(torch.randn(V, H, generator=g))
    model.double()
    a, _, e = slice_rows(n, STEPS, part, parts)
    batch = build_batch(ids, mask, hidden[a:e], starts, LAYOUT, STEPS, None, part, parts)
    aux, final = batch.values(torch.float64)
    logits = model(aux, batch.tokens, batch.positions, batch.doc, STEPS, split)
    loss, _ = ttt_loss(logits, final @ head, batch, 0.8)
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    return loss.detach(), [x.detach() for x in logits], grads


def main(out: str, attention: str, checkpointing: str, decoder: str = "llama"):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    split = split_groups(world, world, rank)
    loss, logits, grads = pack_loss(attention, checkpointing == "1", rank, world, split, decoder)
    dist.all_reduce(loss)
    for grad in grads.values():
        dist.all_reduce(grad)
    gathered = []
    for step in logits:
        parts = [torch.empty_like(step) for _ in range(world)]
        dist.all_gather(parts, step)
        gathered.append(torch.cat(parts)[: sum(LENGTHS)])
    if rank == 0:
        torch.save({"loss": loss, "logits": gathered, "grads": grads}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
