# One summary table of every shard's verification report (each extract job verifies the shard
# it wrote: extract.smk); a table, so local on a cluster.


localrules:
    verify_summary,


rule verify_summary:
    input:
        reports=per_shard(".verify.json"),
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
