from pathlib import Path

from eagleflow.data.shards import TokenShardOutputs, shard_dataset
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    shard_dataset(
        list(snakemake.input.data),
        snakemake.params.target,
        TokenShardOutputs(
            Path(snakemake.output.tokens),
            Path(snakemake.output.manifest),
            Path(snakemake.output.rejects),
        ),
        shard_size=snakemake.params.shard_size,
        max_length=snakemake.params.max_length,
        on_bad_row=snakemake.params.on_bad_row,
        earlier_rejects=list(snakemake.input.regeneration_rejects),
    )
