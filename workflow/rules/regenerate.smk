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
        gpu=jobres.extract_gpu_resource(EXTRACT),
        gres=jobres.extract_gres(EXTRACT),
        nodes=jobres.extract_nodes(EXTRACT),
        cpus_per_task=jobres.extract_cpus(EXTRACT),
        runtime=lambda wildcards, attempt: REGENERATE["runtime_minutes"] * attempt,
    params:
        target=TARGET,
        max_length=config["data"]["max_length"],
        max_new_tokens=REGENERATE["max_new_tokens"],
        on_bad_row=config["data"]["on_bad_row"],
        # What shapes the replies; the engine's other settings come from the config
        # (EngineSettings.from_config) and change nothing in them.
        mla=REGENERATE["mla"],
    script:
        "../scripts/regenerate.py"
