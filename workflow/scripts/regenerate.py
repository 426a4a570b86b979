from pathlib import Path

from eagleflow.data.regenerate import ShardFiles, regenerate_source_shard
from eagleflow.data.sources import read_manifest
from eagleflow.engine.settings import EngineSettings
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    regenerate_source_shard(
        snakemake.input.data,
        read_manifest(snakemake.input.sources),
        snakemake.wildcards.source,
        snakemake.params.target,
        ShardFiles(
            Path(snakemake.output.rows),
            Path(snakemake.output.rejects),
            Path(snakemake.output.summary),
        ),
        max_length=snakemake.params.max_length,
        max_new_tokens=snakemake.params.max_new_tokens,
        chunk_rows=snakemake.params.chunk_rows,
        on_bad_row=snakemake.params.on_bad_row,
        engine=EngineSettings.from_config(snakemake.config, "regenerate"),
    )
