# Fail fast, before any model loads: versions, devices, memory, disk, model config, layer ids.


rule validate_env:
    input:
        manifest=shard_manifest,
        config=f"{TARGET}/config.json",
    output:
        f"{HIDDEN}/validate_env.json",
    log:
        f"{R}/logs/validate_env/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/validate_env/{{fp}}.tsv"
    conda:
        CONDA_ENV
    params:
        target=lambda wildcards, input: os.path.dirname(input.config),
        extract=config["extract"],
        capture=config["capture"],
        results_dir=lambda wildcards, output: str(Path(output[0]).parents[2]),
    script:
        "../scripts/validate_env.py"
