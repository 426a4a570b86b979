from contextlib import ExitStack
from pathlib import Path

from eagleflow.engine.settings import EngineSettings
from eagleflow.logs import redirect_to_log
from eagleflow.regenerate.replies import generator_for
from eagleflow.regenerate.shard import (
    Regeneration,
    ShardFiles,
    SourceShard,
    regenerate_source_shard,
)
from eagleflow.regenerate.sources import read_manifest
from eagleflow.serve.client import engine_server

# vLLM spawns its engine core for some targets (TP > 1, multimodal wrappers): the spawned
# process imports this file again, without the `snakemake` object.
if __name__ == "__main__":
    # Settings from the config, not params (see regenerate.smk): what changes the replies is in
    # the source shard id already.
    config = snakemake.config
    out = snakemake.output
    with redirect_to_log(snakemake.log[0]), ExitStack() as stack:
        settings = EngineSettings.from_config(config, "regenerate")
        regeneration = Regeneration.from_config(config)
        # The shared generate server (docs/engine-reuse.md#regeneration), or None for an engine
        # of the job's own. Connected only when the shard has chunks to answer (the client logs
        # whether it started the server or reuses one); stays connected until the shard's files
        # and summary are written, so the server's idle clock starts when the job ends.
        server = engine_server(config, settings, None, out.rows, snakemake.log[0])
        regenerate_source_shard(
            SourceShard(
                Path(snakemake.input.data),
                read_manifest(snakemake.input.sources),
                snakemake.wildcards.source,
            ),
            ShardFiles(Path(out.rows), Path(out.rejects), Path(out.summary)),
            regeneration,
            generator_for(
                settings,
                regeneration.max_new_tokens,
                server,
                stack,
                keep_special_tokens=regeneration.keeps_special_tokens,
            ),
        )
