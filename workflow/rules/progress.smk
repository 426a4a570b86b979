# Progress and deep verification: targets that inspect, never extract.


# The progress report reads the manifests and a few headers: where Snakemake runs, also on a
# cluster. With regeneration on, it reports regeneration and waits for nothing but the split
# into source shards; extraction is reported once every source shard is regenerated.
localrules:
    progress,


rule progress:
    input:
        unpack(progress_inputs),
    log:
        f"{R}/logs/progress.log",
    conda:
        CONDA_ENV
    params:
        extraction=progress_extraction,
        regenerated_dir=f"{R}/regenerated",
        max_new_tokens=REGENERATE["max_new_tokens"],
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
