# Fail fast, before any model loads: versions, devices, memory, disk, model config, layer ids.
# Local on a cluster (the login node has no GPUs): there the device and memory checks are
# left to each extract job, which runs them before loading the model.


localrules:
    validate_env,


rule validate_env:
    input:
        # ancient: a data change must not re-run validation, and with it patch (see extract.smk).
        manifest=lambda wildcards: ancient(shard_manifest()),
        config=f"{TARGET}/config.json",
    output:
        f"{HIDDEN}/validate_env.json",
    log:
        f"{R}/logs/validate_env/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/validate_env/{{fp}}.tsv"
    conda:
        CONDA_ENV
    resources:
        # A resource, not a param: where jobs run must not trigger a rerun.
        device_checks=lambda wildcards: int(device_checks_here()),
    params:
        target=lambda wildcards, input: os.path.dirname(input.config),
        # extract and capture are rerun triggers only (the script reads the whole config): a
        # change of the engine or capture settings re-validates.
        extract={
            k: config["extract"][k]
            for k in (
                "device",
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "nodes",
                "dtype",
                "cpu_kvcache_space_gib",
                "gpu_memory_utilization",
            )
        },
        # storage_dtype, which the disk check reads, is in the fingerprint (CAPTURE_PARAMS).
        capture=CAPTURE_PARAMS,
        results_dir=lambda wildcards, output: str(Path(output[0]).parents[2]),
    script:
        "../scripts/validate_env.py"
