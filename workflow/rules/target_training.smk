# The embedded tiny target, briefly trained on the bundled corpus so its greedy outputs are
# meaningful (a random target's near-flat distributions make acceptance length noise).
# Built from the untrained fixture (tiny_target) into its own directory (TRAINED_TINY_TARGET,
# common.smk); config/config.yaml points `target.path` there, so the embedded default's
# pipeline uses the trained target. Extraction tests pin the untrained one
# (tests/support/workflow_runner.py).


localrules:
    train_tiny_target,


rule train_tiny_target:
    input:
        data=BUNDLED_DATA,
        base=[f"{TINY_TARGET}/{name}" for name in TINY_TARGET_FILES],
    output:
        [f"{TRAINED_TINY_TARGET}/{name}" for name in TINY_TARGET_FILES],
        summary=f"{TRAINED_TINY_TARGET}/train_summary.json",
    log:
        f"{R}/logs/train_tiny_target.log",
    benchmark:
        f"{R}/benchmarks/train_tiny_target.tsv"
    conda:
        CONDA_ENV
    threads: all_cores_or(8)
    params:
        base=lambda wildcards, input: os.path.dirname(input.base[0]),
        out_dir=lambda wildcards, output: os.path.dirname(output.summary),
        cfg=config["target_training"],
        heldout_modulus=config["data"]["heldout_modulus"],
    script:
        "../scripts/train_tiny_target.py"
