# eagleflow: vLLM target -> hidden states -> EAGLE-3 draft.
# Usage: `snakemake --cores all` (extract, train the draft, export, evaluate),
# `snakemake --cores all extract` (extraction only), `snakemake --profile slurm` (cluster).
from snakemake.utils import min_version

# The Snakemake the workflow is tested with (envs/requirements-cpu.txt): executor plugins,
# `--sdm conda`, checkpoint and input-function behaviour as they are there.
min_version("9.27")


configfile: "config/config.yaml"


# Config, paths, parse-time checks and input functions (common.smk); resource functions
# (resources.smk); then the job rules of each stage, in the order the data flows.
include: "workflow/rules/common.smk"
include: "workflow/rules/resources.smk"
include: "workflow/rules/embedded.smk"
include: "workflow/rules/target_training.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/shard.smk"
include: "workflow/rules/patch.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/verify.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"


# The targets: rules without wildcards, named on the command line (`snakemake <target>`,
# README.md#targets); `all` is the default. Their input functions are in common.smk. Paths
# here are relative to this file (CONDA_ENV is to workflow/rules/).
rule all:
    default_target: True
    input:
        stored_extraction,
        evaluation_outputs,


rule extract:
    # Every shard extracted and verified.
    input:
        extraction_summary,


rule prepare:
    # Everything before extraction: shards, validation, fingerprint and the checked capture
    # plan. Loads no model.
    input:
        lambda wc: f"{hidden_dir()}/capture_plan.json",


rule regenerate:
    # Every source shard regenerated (no sharding, no extraction).
    input:
        regenerated_files(".jsonl"),


rule reference_check:
    # The current configuration's reference check (reference.smk).
    input:
        lambda wc: f"{hidden_dir()}/reference_check.tsv",


# The progress report reads the manifests, a few headers and the trainer's progress.json: where
# Snakemake runs, also on a cluster. With regeneration on, it reports regeneration and waits for
# nothing but the split into source shards; extraction and draft training are reported once
# every source shard is regenerated.
localrules:
    progress,


rule progress:
    input:
        unpack(progress_inputs),
    log:
        f"{R}/logs/progress.log",
    conda:
        "envs/vllm-cuda.yaml"
    params:
        extraction=progress_extraction,
        training=progress_training,
        regenerated_dir=f"{R}/regenerated",
        max_new_tokens=REGENERATE["max_new_tokens"],
        dtype=config["extract"]["dtype"],
        storage_dtype=config["capture"]["storage_dtype"],
    script:
        "workflow/scripts/progress.py"


rule verify_deep:
    # Re-hashes and re-verifies every shard of the current configuration, naming each failure.
    input:
        shards=current_shard_files(".safetensors"),
        records=current_shard_files(".json"),
        tokens=lambda wc: [f"{R}/shards/tokens/{s}.safetensors" for s in shard_ids()],
        plan=lambda wc: f"{hidden_dir()}/capture_plan.json",
    log:
        f"{R}/logs/verify_deep.log",
    conda:
        "envs/vllm-cuda.yaml"
    params:
        dtype=config["extract"]["dtype"],
    script:
        "workflow/scripts/verify_deep.py"
