# Response regeneration, per source shard: the dataset's assistant turns replaced by the
# target's own greedy replies through vLLM (prompt-only datasets completed the same way).
# split_sources cuts data.path into content-addressed source shards
# (eagleflow.regenerate.sources); one regenerate_shard job per shard commits its replies in
# chunks and resumes after a kill (eagleflow.regenerate.shard); with extract.engine_reuse the
# jobs share one loaded engine (docs/engine-reuse.md#regeneration). The shard rule reads the
# regenerated shards in dataset order; the `regenerate` target (Snakefile) asks for them all.


localrules:
    split_sources,


checkpoint split_sources:
    input:
        data=config["data"]["path"],
        # The ids hash the target's identity: the embedded target must exist first.
        target=target_files,
    output:
        manifest=SOURCES_MANIFEST,
    log:
        f"{R}/logs/split_sources.log",
    benchmark:
        f"{R}/benchmarks/split_sources.tsv"
    conda:
        CONDA_ENV
    params:
        target=TARGET,
        revision=config["target"]["revision"],
        shard_rows=REGENERATE["shard_rows"] or config["data"]["shard_size"],
        max_length=config["data"]["max_length"],
        max_new_tokens=REGENERATE["max_new_tokens"],
        mla=REGENERATE["mla"],
        chat_template_kwargs=config["data"]["chat_template_kwargs"],
        reasoning_parser=REGENERATE["reasoning_parser"],
        on_truncated=REGENERATE["on_truncated"],
        tool_parser=REGENERATE["tool_parser"],
    script:
        "../scripts/split_sources.py"


# Every input is content-addressed by the wildcard (the source shard id hashes the rows, the
# target and the generation settings), so all are ancient(): a re-split, a touched dataset or
# target file never regenerates a finished shard. No params: the script reads the rest of its
# settings (chunk_rows, on_bad_row, engine) from the config; a params change would regenerate
# every shard for settings that do not change the replies.
rule regenerate_shard:
    input:
        data=ancient(config["data"]["path"]),
        sources=ancient(SOURCES_MANIFEST),
        target=lambda wildcards: [ancient(f) for f in target_files()],
    output:
        rows=f"{R}/regenerated/{{source}}.jsonl",
        rejects=f"{R}/regenerated/{{source}}.rejects.jsonl",
        summary=f"{R}/regenerated/{{source}}.summary.json",
    log:
        f"{R}/logs/regenerate/{{source}}.log",
    benchmark:
        f"{R}/benchmarks/regenerate/{{source}}.tsv"
    # extract.shards_per_allocation > 1: N source shards per SLURM allocation, answered by one
    # generate engine server (resources.smk, docs/engine-reuse.md#regeneration); None otherwise.
    group:
        REGENERATE_GROUP
    conda:
        CONDA_ENV
    threads: extract_threads
    resources:
        gpu=jobres.extract_gpu_resource(EXTRACT),
        gres=jobres.extract_gres(EXTRACT),
        nodes=jobres.extract_nodes(EXTRACT),
        cpus_per_task=jobres.extract_cpus(EXTRACT),
        mem_mb=extract_mem_mb,
        runtime=regenerate_runtime,
    script:
        "../scripts/regenerate.py"
