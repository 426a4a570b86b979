# eagleflow: vLLM target -> hidden states -> EAGLE-3 draft.
# Usage: `snakemake --cores all` (extract, train the draft, export, evaluate),
# `snakemake --cores all extract` (extraction only), `snakemake --profile slurm` (cluster).
from snakemake.utils import min_version

# The Snakemake the workflow is tested with (envs/requirements-cpu.txt): executor plugins,
# `--sdm conda`, checkpoint and input-function behaviour as they are there.
min_version("9.27")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/resources.smk"
include: "workflow/rules/draft_common.smk"
include: "workflow/rules/embedded.smk"
include: "workflow/rules/target_training.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/shard.smk"
include: "workflow/rules/patch.smk"
include: "workflow/rules/extract.smk"
include: "workflow/rules/verify.smk"
include: "workflow/rules/progress.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"


rule all:
    default_target: True
    input:
        extraction_summary,
        evaluation_outputs,


rule extract:
    input:
        extraction_summary,
