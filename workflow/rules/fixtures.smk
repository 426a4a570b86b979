# The embedded default: a bundled chat dataset and a tiny DeepseekV3 target, both built here.
# Seconds of work each: on a cluster they run where Snakemake runs, not as jobs.


localrules:
    bundled_dataset,
    tiny_target,


rule bundled_dataset:
    output:
        BUNDLED_DATA,
    log:
        f"{R}/logs/bundled_dataset.log",
    benchmark:
        f"{R}/benchmarks/bundled_dataset.tsv"
    conda:
        CONDA_ENV
    params:
        n=config["data"]["bundled_conversations"],
        seed=config["data"]["bundled_seed"],
    script:
        "../scripts/bundled_dataset.py"


rule tiny_target:
    input:
        BUNDLED_DATA,
    output:
        [f"{TINY_TARGET}/{name}" for name in TINY_TARGET_FILES],
    log:
        f"{R}/logs/tiny_target.log",
    benchmark:
        f"{R}/benchmarks/tiny_target.tsv"
    conda:
        CONDA_ENV
    params:
        seed=config["target"]["tiny_seed"],
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    script:
        "../scripts/tiny_target.py"
