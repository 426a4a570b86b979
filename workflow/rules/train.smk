# Draft: vocabulary from the loss-masked tokens, TTT training, speculators-format export.
# Inputs are every verified shard of extraction {fp}; outputs go under results/draft/{fp}/.
# The trainer works in train.work/ (not an output, so a crashed or timed-out job's checkpoint
# survives Snakemake's cleanup) and resumes from there when the checkpoint is this run's
# (same seed, recipe, draft and shards; eagleflow.plan.settings.recipe_of), at any world
# size; train/best/ is the draft with the best simulated acceptance length, what export reads.

DRAFT = f"{R}/draft/{{fp}}"
# draft.states (docs/streaming.md): stored reads the extracted shards; stream and cached read
# the token shards, and the capture server prefills their states while the trainer runs.
STORED = DRAFT_SETTINGS.states.stored


rule draft_vocab:
    input:
        shards=draft_shards,
        verified=f"{HIDDEN}/verify_summary.tsv" if STORED else [],
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
        size=DRAFT_SETTINGS.vocab_size,
        heldout_modulus=DRAFT_SETTINGS.heldout_modulus,
    script:
        "../scripts/draft_vocab.py"


rule train_draft:
    input:
        shards=draft_shards,
        vocab=f"{DRAFT}/vocab.safetensors",
        plan=[] if STORED else ancient(f"{HIDDEN}/capture_plan.json"),
    output:
        best=directory(f"{DRAFT}/train/best"),
        summary=f"{DRAFT}/train/summary.json",
        metrics=f"{DRAFT}/train/metrics.csv",
        validation=f"{DRAFT}/train/validation.csv",
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
    # draft.nodes x draft.processes_per_node ranks: torchrun on this machine, or one srun task
    # per rank in the job's SLURM allocation (eagleflow.plan.launch); the job asks for them,
    # their GPUs, CPUs and memory, and a runtime sized from the tokens to train and the rate
    # (resources.smk, eagleflow.plan.resources, docs/slurm.md).
    threads: train_threads
    resources:
        nodes=TRAIN_SLURM["nodes"],
        gpu=TRAIN_SLURM["gpu"],
        gres=TRAIN_SLURM["gres"],
        mpi=train_mpi,
        tasks_per_node=TRAIN_SLURM["tasks_per_node"],
        tasks=TRAIN_SLURM["tasks"],
        tasks_per_gpu=TRAIN_SLURM["tasks_per_gpu"],
        cpus_per_task=TRAIN_SLURM["cpus_per_task"],
        mem_mb=train_mem_mb,
        runtime=train_runtime,
    # The settings that decide the weights or the run's extent (a change re-runs the job,
    # which resumes or restarts); the script reads the others (launch, validation and
    # checkpoint intervals, data loading) from the same typed settings.
    params:
        target=TARGET,
        workdir=f"{DRAFT}/train.work",
        recipe=DRAFT_SETTINGS.recipe(),
    script:
        "../scripts/train_draft.py"


rule export_draft:
    input:
        best=f"{DRAFT}/train/best",
        shards=draft_shards,
        plan=[] if STORED else ancient(f"{HIDDEN}/capture_plan.json"),
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
        speculative_tokens=DRAFT_SETTINGS.speculative_tokens,
    script:
        "../scripts/export_draft.py"
