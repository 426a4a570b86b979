# One job per shard: load the target in vLLM once, prefill the shard, capture the planned
# layers, commit chunks, write one safetensors file atomically, then verify it (keys, shapes,
# dtypes, values, alignment with the tokenized shard): the report is written last, and a shard
# that fails verification is moved to quarantine (eagleflow.store.verify.verify_extracted_shard).
# Both inputs are content-addressed by their paths (the shard id hashes the tokens, the
# fingerprint hashes what makes the tensors), so a newer mtime cannot mean new content:
# they are ancient() and never trigger re-extraction.
# Caveat (Snakemake 9.27): a job whose ancient() input's producer re-runs is dropped from
# the DAG even when its own output is missing (update_needrun masks everything downstream of
# a needrun job, then skips ancient edges). So patch's input is ancient too, and the targets
# name validate_env's record directly (common.smk: extraction_summary), from which Snakemake
# walks back to every extract job whose shard is missing.


rule extract_shard:
    input:
        tokens=ancient(f"{R}/shards/tokens/{{shard}}.safetensors"),
        plan=ancient(f"{HIDDEN}/capture_plan.json"),
    output:
        hidden=f"{HIDDEN}/{{shard}}.safetensors",
        record=f"{HIDDEN}/{{shard}}.json",
        report=f"{HIDDEN}/{{shard}}.verify.json",
    log:
        f"{R}/logs/extract/{{fp}}/{{shard}}.log",
    benchmark:
        f"{R}/benchmarks/extract/{{fp}}/{{shard}}.tsv"
    # extract.shards_per_allocation > 1: N shards per SLURM allocation, served by one engine
    # (resources.smk, docs/engine-reuse.md); None otherwise (and always when run locally).
    group:
        EXTRACT_GROUP
    conda:
        CONDA_ENV
    # One engine per machine when run locally (it uses every core); on a cluster the job asks
    # for its nodes (extract.nodes) with TP x PP / nodes GPUs each, CPUs and memory to match,
    # and a runtime estimated from the shard's tokens, the throughput, the model load time
    # and the verification read (docs/slurm.md).
    threads: extract_threads
    resources:
        gpu=jobres.extract_gpu_resource(EXTRACT),
        gres=jobres.extract_gres(EXTRACT),
        nodes=jobres.extract_nodes(EXTRACT),
        cpus_per_task=jobres.extract_cpus(EXTRACT),
        mem_mb=extract_mem_mb,
        runtime=extract_runtime,
    # No params: a params change would re-run every shard; what shapes the tensors is in the
    # fingerprint, and the script reads the engine settings from the config.
    script:
        "../scripts/extract_shard.py"
