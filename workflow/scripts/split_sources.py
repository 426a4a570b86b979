from eagleflow.extract.fingerprint import target_identity
from eagleflow.logs import redirect_to_log
from eagleflow.regenerate.sources import regeneration_identity, split_sources, write_manifest

with redirect_to_log(snakemake.log[0]):
    p = snakemake.params
    identity = regeneration_identity(
        target_identity(p.target, p.revision),
        p.max_new_tokens,
        p.max_length,
        p.mla,
        dict(p.chat_template_kwargs),
        p.reasoning_parser,
        p.on_truncated,
        p.tool_parser,
    )
    manifest = split_sources(snakemake.input.data, identity, p.shard_rows)
    write_manifest(manifest, snakemake.output.manifest)
    shards = manifest["shards"]
    print(
        f"split {snakemake.input.data}: {manifest['rows_read']} rows into {len(shards)} source "
        f"shards of up to {p.shard_rows} rows; {sum(s['prompts'] for s in shards)} user turns"
    )
