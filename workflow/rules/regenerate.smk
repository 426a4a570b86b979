# Response regeneration: the dataset's assistant turns replaced by the target's own greedy
# replies through vLLM (prompt-only datasets completed the same way); its output is the
# dataset the shard rule reads when `data.regenerate.enabled` is set.


rule regenerate:
    input:
        data=config["data"]["path"],
        target=target_files,
    output:
        data=REGENERATED_DATA,
        rejects=f"{R}/regenerated/rejects.jsonl",
        summary=f"{R}/regenerated/summary.json",
    log:
        f"{R}/logs/regenerate.log",
    benchmark:
        f"{R}/benchmarks/regenerate.tsv"
    conda:
        CONDA_ENV
    threads: extract_threads
    resources:
        gpu=jobres.extract_gpus(EXTRACT),
        cpus_per_task=jobres.extract_cpus(EXTRACT),
        runtime=lambda wildcards, attempt: REGENERATE["runtime_minutes"] * attempt,
    params:
        target=TARGET,
        max_length=config["data"]["max_length"],
        max_new_tokens=REGENERATE["max_new_tokens"],
        on_bad_row=config["data"]["on_bad_row"],
        engine={
            "device": EXTRACT["device"],
            "tensor_parallel_size": EXTRACT["tensor_parallel_size"],
            "dtype": EXTRACT["dtype"],
            "gpu_memory_utilization": EXTRACT["gpu_memory_utilization"],
            "cpu_kvcache_space_gib": EXTRACT["cpu_kvcache_space_gib"],
            "cpu_threads_bind": EXTRACT["cpu_threads_bind"],
            "max_num_seqs": REGENERATE["max_num_seqs"],
            "mla": REGENERATE["mla"],
        },
    script:
        "../scripts/regenerate.py"
