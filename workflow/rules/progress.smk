# Progress and deep verification: targets that inspect, never extract.


# The progress report reads the manifest and a few headers: where Snakemake runs, also on a
# cluster.
localrules:
    progress,


rule progress:
    input:
        manifest=shard_manifest,
        fingerprint=lambda wc: f"{hidden_dir()}/fingerprint.json",
    log:
        f"{R}/logs/progress.log",
    conda:
        CONDA_ENV
    params:
        hidden_dir=hidden_dir,
        layer_ids=after_sharding(layer_ids),
        hidden_size=after_sharding(lambda: read_target(TARGET).hidden_size),
        dtype=config["extract"]["dtype"],
        storage_dtype=config["capture"]["storage_dtype"],
    script:
        "../scripts/progress.py"


rule verify_deep:
    input:
        shards=current_shard_files(".safetensors"),
        records=current_shard_files(".json"),
        tokens=lambda wc: [f"{R}/shards/tokens/{s}.safetensors" for s in shard_ids()],
        plan=lambda wc: f"{hidden_dir()}/capture_plan.json",
    log:
        f"{R}/logs/verify_deep.log",
    conda:
        CONDA_ENV
    params:
        dtype=config["extract"]["dtype"],
    script:
        "../scripts/verify_deep.py"


rule prepare:
    # Everything before extraction: shards, validation, fingerprint and the checked capture
    # plan. Loads no model.
    input:
        lambda wc: f"{hidden_dir()}/capture_plan.json",
