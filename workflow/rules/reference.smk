# The check against an independent reference: a sample of finished shards compared with a
# transformers forward of the same weights (float32), per layer. Users run it on real shards
# on their own hardware: `snakemake --cores all reference_check` (the target, in the Snakefile, asks
# for the current configuration's table).


rule reference_check_shards:
    input:
        shards=lambda wc: per_shard(".safetensors")(wc)[: config["reference"]["shards"]],
    output:
        table=report(
            f"{HIDDEN}/reference_check.tsv",
            caption="../report/reference.rst",
            category="Extraction",
        ),
    log:
        f"{R}/logs/reference_check/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/reference_check/{{fp}}.tsv"
    conda:
        CONDA_ENV
    params:
        target=TARGET,
        samples_per_shard=config["reference"]["samples_per_shard"],
        device=config["reference"]["device"],
    script:
        "../scripts/reference_check.py"
