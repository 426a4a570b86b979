from pathlib import Path

from eagleflow.data.shards import TokenShardOutputs, shard_dataset
from eagleflow.data.templating import TemplateSettings
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    shard_dataset(
        list(snakemake.input.data),
        snakemake.params.target,
        TokenShardOutputs(
            Path(snakemake.output.tokens),
            Path(snakemake.output.manifest),
            Path(snakemake.output.rejects),
            Path(snakemake.output.summary),
        ),
        shard_size=snakemake.params.shard_size,
        max_length=snakemake.params.max_length,
        on_bad_row=snakemake.params.on_bad_row,
        template=TemplateSettings(
            dict(snakemake.params.chat_template_kwargs), snakemake.params.reasoning_samples
        ),
        on_unrendered_field=snakemake.params.on_unrendered_field,
        earlier_rejects=list(snakemake.input.regeneration_rejects),
    )
