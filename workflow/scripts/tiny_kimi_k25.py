import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train_tiny_target.py

import json
from dataclasses import replace

from eagleflow.data.conversations import read_conversations
from eagleflow.embedded.tiny_kimi import build_tiny_kimi
from eagleflow.embedded.train_target import TargetTrainConfig
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    import torch

    torch.set_num_threads(snakemake.threads)
    conversations, _ = read_conversations(snakemake.input.data)
    settings = dict(snakemake.params.cfg)
    first = settings.pop("empty_system_phase")
    cfg = TargetTrainConfig(**settings, heldout_modulus=snakemake.params.heldout_modulus)
    first_cfg = replace(cfg, **first) if first["steps"] else None
    summary = build_tiny_kimi(
        conversations,
        snakemake.params.out_dir,
        cfg,
        seed=snakemake.params.seed,
        empty_system_cfg=first_cfg,
    )
    print(json.dumps(summary, indent=1))
