# Tokenize the dataset with the target's chat template and cut it into content-addressed shards.
# The dataset is data.path, or its regenerated source shards in dataset order (regenerate.smk):
# a shard never spans two source shards, so a regenerated source shard changes only its own
# token shards. The held-out split stays in the shards (so shard ids do not move) and is
# skipped by draft training. Regeneration's rejects are gathered into this rule's rejects.


checkpoint shard:
    input:
        data=shard_data,
        tokenizer=tokenizer_files,
        regeneration_rejects=shard_regeneration_rejects,
    output:
        manifest=f"{R}/shards/manifest.parquet",
        tokens=directory(f"{R}/shards/tokens"),
        rejects=f"{R}/shards/rejects.jsonl",
        summary=f"{R}/shards/summary.json",
    log:
        f"{R}/logs/shard.log",
    benchmark:
        f"{R}/benchmarks/shard.tsv"
    conda:
        CONDA_ENV
    resources:
        mem_mb=16000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    params:
        target=TARGET,
        shard_size=config["data"]["shard_size"],
        max_length=config["data"]["max_length"],
        on_bad_row=config["data"]["on_bad_row"],
        chat_template_kwargs=config["data"]["chat_template_kwargs"],
        reasoning_samples=config["data"]["reasoning_samples"],
        on_unrendered_field=config["data"]["on_unrendered_field"],
    script:
        "../scripts/shard.py"
