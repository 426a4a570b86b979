# eagleflow: vLLM target -> hidden states -> EAGLE-3 draft.
# Usage: `snakemake --cores all extract` (one machine), `snakemake --profile slurm` (cluster).


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/fixtures.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/shard.smk"
include: "workflow/rules/patch.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/verify.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/target_training.smk"


rule all:
    default_target: True
    input:
        extraction_summary,


rule extract:
    input:
        extraction_summary,
