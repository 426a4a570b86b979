"""The draft memory plan's table for Kimi-K2.5 (or any target's config.json), as markdown.

A calculation (`eagleflow.train.memory_plan`), not a GPU measurement. docs/draft-memory.md
holds its output; regenerate it with

    python benchmarks/memory_plan_table.py > /tmp/table.md
    python benchmarks/memory_plan_table.py --target-config /models/X/config.json --ranks 16
    python benchmarks/memory_plan_table.py --architecture mla   # the MLA draft's table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from eagleflow.draft.model import draft_config_for  # noqa: E402
from eagleflow.train.memory_plan import GB, Workload, plan_memory  # noqa: E402

# Kimi-K2.5's text model as its config.json publishes it (`text_config`), the fields a draft
# is sized from (its MLA shape for `draft.architecture: mla`; the rope does not change memory).
KIMI_K25 = {
    "text_config": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "vocab_size": 163840,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    }
}
# Memory as torch.cuda reports it (GiB): H100 SXM 80 GB, H200 141 GB.
DEVICES = {"H100": 79.1, "H200": 139.8}


def device_plans(cfg, workload: Workload) -> list:
    """The plan of `workload` against each of `DEVICES` (the parts do not depend on it)."""
    return [plan_memory(cfg, workload, int(gib * GB)) for gib in DEVICES.values()]


def table_row(labels: list, cells: list[int], plans: list) -> str:
    """A markdown row: the labels, the byte counts in GiB, whether each device fits."""
    values = [*map(str, labels), *(f"{c / GB:.1f}" for c in cells)]
    values += ["yes" if p.fits else "**no**" for p in plans]
    return "| " + " | ".join(values) + " |"


def table(
    target_config: dict, ranks: int, draft_vocab: int, num_aux: int, decoder: str = "llama"
) -> str:
    """One row per (sequence, TTT steps, checkpointing): GiB per device by part, and whether
    it fits each of `DEVICES` (the parts do not depend on the device)."""
    fits = " | ".join(f"fits {name}" for name in DEVICES)
    rows = [
        "| sequence | TTT | ckpt | params+grads+optimizer | working | frozen | inputs "
        f"| activations | loss | total | {fits} |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|" + "---|" * len(DEVICES),
    ]
    for tokens in (4096, 8192, 16384):
        for steps in (3, 7):
            for ckpt in (False, True):
                cfg = draft_config_for(
                    target_config,
                    draft_vocab,
                    num_aux,
                    activation_checkpointing=ckpt,
                    decoder=decoder,
                )
                plans = device_plans(cfg, Workload(tokens, steps, ranks))
                plan = plans[0]
                state = plan.params + plan.grads + plan.optimizer
                cells = [state, plan.working, plan.frozen, plan.inputs, plan.activations]
                cells += [plan.loss, plan.total]
                labels = [f"{tokens // 1024}k", steps, "on" if ckpt else "off"]
                rows.append(table_row(labels, cells, plans))
    first_cfg = draft_config_for(target_config, draft_vocab, num_aux, decoder=decoder)
    first = plan_memory(first_cfg, Workload(1, 1))
    head = (
        f"{first.trainable_params:,} trainable parameters, {ranks} ranks (FSDP), bf16 autocast, "
        "flex attention; GiB per device; fits: the total is at most 90% of the device's memory "
        f"({', '.join(f'{k} {v} GiB' for k, v in DEVICES.items())}, as torch.cuda reports it)."
    )
    return head + "\n\n" + "\n".join(rows)


def split_table(
    target_config: dict, ranks: int, draft_vocab: int, num_aux: int, decoder: str = "llama"
) -> str:
    """Long packs split over ranks (`draft.sequence_parallel`), at TTT 7 with checkpointing:
    tokens per device, activations, loss and total GiB, and whether each device fits."""
    cfg = draft_config_for(
        target_config, draft_vocab, num_aux, activation_checkpointing=True, decoder=decoder
    )
    fits = " | ".join(f"fits {name}" for name in DEVICES)
    rows = [
        f"| pack | sequence_parallel | tokens per device | activations | loss | total | {fits} |",
        "|---:|---:|---:|---:|---:|---:|" + "---|" * len(DEVICES),
    ]
    for tokens in (16384, 20000, 32768, 65536):
        for parts in (1, 2, 4, 8):
            if ranks % parts:
                continue
            workload = Workload(tokens, 7, ranks, "cuda", parts)
            plans = device_plans(cfg, workload)
            cells = [plans[0].activations, plans[0].loss, plans[0].total]
            labels = [f"{tokens:,}", parts, f"{workload.device_tokens:,}"]
            rows.append(table_row(labels, cells, plans))
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-config", help="a target's config.json (default: Kimi-K2.5's)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--num-aux", type=int, default=3)
    p.add_argument("--architecture", choices=("llama", "mla"), default="llama")
    args = p.parse_args(argv)
    config = json.loads(Path(args.target_config).read_text()) if args.target_config else KIMI_K25
    sizes = (config, args.ranks, args.draft_vocab, args.num_aux, args.architecture)
    print(table(*sizes))
    print("\nSequence splitting, TTT 7, activation checkpointing on:\n")
    print(split_table(*sizes))


if __name__ == "__main__":
    main()
