import json

from eagleflow.conversations import read_conversations
from eagleflow.logs import redirect_to_log
from eagleflow.train_target import TargetTrainConfig, train_target

with redirect_to_log(snakemake.log[0]):
    import torch

    torch.set_num_threads(snakemake.threads)
    conversations, _ = read_conversations(snakemake.input.data)
    cfg = TargetTrainConfig(**snakemake.params.cfg, heldout_modulus=snakemake.params.heldout_modulus)
    summary = train_target(snakemake.params.base, conversations, snakemake.params.out_dir, cfg)
    print(json.dumps(summary, indent=1))
