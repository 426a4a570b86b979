import os

# Idle OpenMP threads sleep instead of spinning: with another process on the cores, spinning
# threads waiting at every op's barrier slow every step many times over
# (docs/measurements/target-training.md). Read by torch's OpenMP runtime when it loads, so
# before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json

from eagleflow.data.conversations import read_conversations
from eagleflow.embedded.train_target import TargetTrainConfig, train_target
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    import torch

    torch.set_num_threads(snakemake.threads)
    conversations, _ = read_conversations(snakemake.input.data)
    settings = dict(snakemake.params.cfg)
    if settings.pop("empty_system_phase")["steps"]:
        raise ValueError(
            "target_training.empty_system_phase is for the Kimi replica (its template adds a "
            "default system turn); the embedded target trains without it: set its steps to 0"
        )
    cfg = TargetTrainConfig(**settings, heldout_modulus=snakemake.params.heldout_modulus)
    summary = train_target(snakemake.params.base, conversations, snakemake.params.out_dir, cfg)
    print(json.dumps(summary, indent=1))
