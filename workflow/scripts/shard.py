from eagleflow.data.shards import shard_dataset
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    shard_dataset(
        list(snakemake.input.data),
        snakemake.params.target,
        snakemake.output.tokens,
        snakemake.output.manifest,
        snakemake.output.rejects,
        shard_size=snakemake.params.shard_size,
        max_length=snakemake.params.max_length,
        on_bad_row=snakemake.params.on_bad_row,
        earlier_rejects=list(snakemake.input.regeneration_rejects),
    )
