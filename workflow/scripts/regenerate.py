from pathlib import Path

from eagleflow.data.regenerate import ShardFiles, regenerate_source_shard
from eagleflow.data.sources import read_manifest
from eagleflow.engine.settings import EngineSettings
from eagleflow.logs import redirect_to_log

# vLLM spawns its engine core for some targets (TP > 1, multimodal wrappers): the spawned
# process imports this file again, without the `snakemake` object.
if __name__ == "__main__":
    # Settings from the config, not params (see regenerate.smk): what changes the replies is in
    # the source shard id already.
    config = snakemake.config
    regen = config["data"]["regenerate"]
    with redirect_to_log(snakemake.log[0]):
        regenerate_source_shard(
            snakemake.input.data,
            read_manifest(snakemake.input.sources),
            snakemake.wildcards.source,
            config["target"]["path"],
            ShardFiles(
                Path(snakemake.output.rows),
                Path(snakemake.output.rejects),
                Path(snakemake.output.summary),
            ),
            max_length=config["data"]["max_length"],
            max_new_tokens=regen["max_new_tokens"],
            chunk_rows=regen["chunk_rows"],
            on_bad_row=config["data"]["on_bad_row"],
            engine=EngineSettings.from_config(config, "regenerate"),
        )
