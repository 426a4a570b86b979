from contextlib import ExitStack
from pathlib import Path

from eagleflow.data.regenerate import ShardFiles, regenerate_source_shard
from eagleflow.data.sources import read_manifest
from eagleflow.engine.settings import EngineSettings
from eagleflow.extract.client import EngineClient, ServerSpec, snakemake_ancestor
from eagleflow.logs import redirect_to_log


def engine_server(config, settings: EngineSettings) -> ServerSpec | None:
    """The shared generate server this job uses (docs/engine-reuse.md#regeneration), or None
    for an engine of its own (`extract.engine_reuse: false`)."""
    ext = config["extract"]
    if not ext["engine_reuse"]:
        return None
    return ServerSpec(
        settings,
        None,
        engine_dir=Path(snakemake.output.rows).parent / ".engine",
        log_dir=Path(snakemake.log[0]).parent,
        idle_seconds=ext["engine_idle_seconds"],
        watch_pid=snakemake_ancestor(),
        kind="generate",
    )


# vLLM spawns its engine core for some targets (TP > 1, multimodal wrappers): the spawned
# process imports this file again, without the `snakemake` object.
if __name__ == "__main__":
    # Settings from the config, not params (see regenerate.smk): what changes the replies is in
    # the source shard id already.
    config = snakemake.config
    regen = config["data"]["regenerate"]
    with redirect_to_log(snakemake.log[0]), ExitStack() as stack:
        settings = EngineSettings.from_config(config, "regenerate")
        server = engine_server(config, settings)
        # Connected only when the shard has chunks to answer (the client logs whether it started
        # the server or reuses one); stays connected until the shard's files and summary are
        # written, so the server's idle clock starts when the job ends.
        generator = (
            (lambda _, n: stack.enter_context(EngineClient(server)).generator(n))
            if server
            else None
        )
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
            engine=settings,
            generator=generator,
        )
