# The embedded default: a bundled chat dataset (real conversations from the pinned
# chitchat-dataset package, or the synthetic task families) and a tiny DeepseekV3 target,
# both built here.
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
        data={k: v for k, v in config["data"].items() if k.startswith("bundled_")},
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


# A tiny replica of Kimi-K2.5's published layout (eagleflow.embedded.tiny_kimi): wrapper
# config, hub tensor names, tiktoken tokenizer shipped as code, Kimi's chat template; built,
# trained on the bundled corpus as the embedded target is, and wrapped, in one job.
rule tiny_kimi_k25:
    input:
        data=BUNDLED_DATA,
    output:
        [f"{TINY_KIMI_TARGET}/{name}" for name in TINY_KIMI_FILES],
        summary=f"{TINY_KIMI_TARGET}/train_summary.json",
    log:
        f"{R}/logs/tiny_kimi_k25.log",
    benchmark:
        f"{R}/benchmarks/tiny_kimi_k25.tsv"
    conda:
        CONDA_ENV
    threads: all_cores_or(8)
    params:
        seed=config["target"]["tiny_seed"],
        out_dir=lambda wildcards, output: os.path.dirname(output.summary),
        cfg=config["target_training"],
        heldout_modulus=config["data"]["heldout_modulus"],
    script:
        "../scripts/tiny_kimi_k25.py"
