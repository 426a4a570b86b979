# Verify every shard (keys, shapes, dtypes, values, alignment), then one summary table.
# A verify job streams one shard (small job); the summary is a table (local on a cluster).


localrules:
    verify_summary,


rule verify_shard:
    input:
        hidden=f"{HIDDEN}/{{shard}}.safetensors",
        record=f"{HIDDEN}/{{shard}}.json",
        tokens=ancient(f"{R}/shards/tokens/{{shard}}.safetensors"),
        plan=ancient(f"{HIDDEN}/capture_plan.json"),
    output:
        f"{HIDDEN}/{{shard}}.verify.json",
    log:
        f"{R}/logs/verify/{{fp}}/{{shard}}.log",
    benchmark:
        f"{R}/benchmarks/verify/{{fp}}/{{shard}}.tsv"
    conda:
        CONDA_ENV
    resources:
        mem_mb=4000,
        runtime=verify_runtime,
    params:
        dtype=config["extract"]["dtype"],
    script:
        "../scripts/verify_shard.py"


rule verify_summary:
    input:
        reports=per_shard(".verify.json"),
        records=per_shard(".json"),
    output:
        table=report(
            f"{HIDDEN}/verify_summary.tsv",
            caption="../report/verify.rst",
            category="Extraction",
        ),
        manifest=f"{HIDDEN}/manifest.parquet",
    log:
        f"{R}/logs/verify_summary/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/verify_summary/{{fp}}.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/verify_summary.py"
