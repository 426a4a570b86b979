# Draft: vocabulary from the loss-masked tokens, TTT training, speculators-format export.
# Inputs are every verified shard of extraction {fp}; outputs go under results/draft/{fp}/.
# The trainer works in train.work/ (not an output, so a crashed job's checkpoint survives
# Snakemake's cleanup) and resumes from there when the checkpoint is this run's (same seed,
# settings, draft and shards; eagleflow.draft.train.training_recipe).

DRAFT = f"{R}/draft/{{fp}}"
DRAFT_CFG = config["draft"]


rule draft_vocab:
    input:
        shards=per_shard(".safetensors"),
        verified=f"{HIDDEN}/verify_summary.tsv",
    output:
        vocab=f"{DRAFT}/vocab.safetensors",
        summary=f"{DRAFT}/vocab.json",
    log:
        f"{R}/logs/draft_vocab/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/draft_vocab/{{fp}}.tsv"
    conda:
        CONDA_ENV
    params:
        target=TARGET,
        size=DRAFT_CFG["vocab_size"],
        heldout_modulus=config["data"]["heldout_modulus"],
    script:
        "../scripts/draft_vocab.py"


rule train_draft:
    input:
        shards=per_shard(".safetensors"),
        vocab=f"{DRAFT}/vocab.safetensors",
    output:
        checkpoint=f"{DRAFT}/train/checkpoint.pt",
        metrics=f"{DRAFT}/train/metrics.csv",
        curves=report(
            f"{DRAFT}/train/curves.png",
            caption="../report/draft_training.rst",
            category="Draft",
        ),
    log:
        f"{R}/logs/train_draft/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/train_draft/{{fp}}.tsv"
    conda:
        CONDA_ENV
    threads: all_cores_or(8)
    params:
        target=TARGET,
        workdir=f"{DRAFT}/train.work",
        train={**DRAFT_CFG, "heldout_modulus": config["data"]["heldout_modulus"]},
    script:
        "../scripts/train_draft.py"


rule export_draft:
    input:
        checkpoint=f"{DRAFT}/train/checkpoint.pt",
        shards=per_shard(".safetensors"),
    output:
        config=f"{DRAFT}/export/config.json",
        weights=f"{DRAFT}/export/model.safetensors",
    log:
        f"{R}/logs/export_draft/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/export_draft/{{fp}}.tsv"
    conda:
        CONDA_ENV
    params:
        target=TARGET,
        outdir=f"{DRAFT}/export",
        speculative_tokens=DRAFT_CFG["speculative_tokens"],
    script:
        "../scripts/export_draft.py"
