# One job per shard: load the target in vLLM once, prefill the shard, capture the planned
# layers, commit chunks, write one safetensors file atomically.
# The tokens are content-addressed by their path (the shard id hashes them), so a newer mtime
# cannot mean new content: ancient() keeps it from triggering re-extraction. The capture
# plan (<hidden dir>/capture_plan.json) is read by the script, not declared as an input: `patch` is a checkpoint
# that every per-shard job list waits for (see common.smk), so extract jobs are scheduled
# only once the plan exists, and a re-run of validate_env or patch (same plan, by
# construction) never touches finished shards. (Declaring it ancient() would not do:
# Snakemake 9.27 drops a job whose ancient input's producer re-runs.)


rule extract_shard:
    input:
        tokens=ancient(f"{R}/shards/tokens/{{shard}}.safetensors"),
    output:
        hidden=f"{HIDDEN}/{{shard}}.safetensors",
        record=f"{HIDDEN}/{{shard}}.json",
    log:
        f"{R}/logs/extract/{{fp}}/{{shard}}.log",
    benchmark:
        f"{R}/benchmarks/extract/{{fp}}/{{shard}}.tsv"
    conda:
        CONDA_ENV
    # One engine per machine when run locally (it uses every core); on a cluster the job asks
    # for GPUs on one node, CPUs and memory to match, and a runtime estimated from the
    # shard's tokens, the throughput and the model load time (README, "On a SLURM cluster").
    threads: extract_threads
    resources:
        gpu=jobres.extract_gpus(EXTRACT),
        nodes=1,
        cpus_per_task=jobres.extract_cpus(EXTRACT),
        mem_mb=extract_mem_mb,
        runtime=extract_runtime,
    # No params: a params change would re-run every shard; what shapes the tensors is in the
    # fingerprint, and the script reads the engine settings from the config.
    script:
        "../scripts/extract_shard.py"
