# Cluster resources, read by snakemake-executor-plugin-slurm (docs/slurm.md);
# on one machine only `threads` matters (and train_draft's `mpi`). The logic is in
# eagleflow.extract.resources and eagleflow.plan.resources, the measured rates in
# eagleflow.extract.rates and the trainer's progress.json (as `snakemake progress` reads them).
import eagleflow.plan.resources as trainres
import eagleflow.extract.resources as jobres
from eagleflow.extract.rates import extraction_timings, measure, regeneration_timings

EXTRACT = config["extract"]


@cache
def target_weight_bytes():
    from eagleflow.target.info import weight_bytes

    return weight_bytes(read_target(TARGET))


@cache
def measured_rates(fp):
    """Throughput and model load measured by this extraction's finished shards (read once)."""
    return measure(extraction_timings(HIDDEN.format(fp=fp)))


@cache
def measured_regeneration():
    """The same, measured by the finished regeneration shards."""
    return measure(regeneration_timings(f"{R}/regenerated"))


def extract_mem_mb(wildcards):
    return jobres.extract_mem_mb(EXTRACT, target_weight_bytes())


def extract_runtime(wildcards, input, attempt):
    """Minutes for one shard: its tokens, the model load and the verification read
    (jobres.job_runtime_minutes, docs/slurm.md)."""
    n_tokens = jobres.shard_tokens(input.tokens)
    return jobres.job_runtime_minutes(
        EXTRACT,
        n_tokens,
        measured_rates(wildcards.fp),
        EXTRACT["tokens_per_second"],
        jobres.verify_minutes(
            n_tokens, len(layer_ids()), read_target(TARGET).hidden_size
        ),
        attempt,
    )


def regenerate_runtime(wildcards, attempt):
    """Minutes for one source shard: its user turns x max_new_tokens, at
    data.regenerate.tokens_per_second until a finished shard has measured the rate, and the
    model load (jobres.job_runtime_minutes, docs/slurm.md)."""
    (entry,) = [s for s in source_shards() if s["id"] == wildcards.source]
    return jobres.job_runtime_minutes(
        EXTRACT,
        entry["prompts"] * REGENERATE["max_new_tokens"],
        measured_regeneration(),
        REGENERATE["tokens_per_second"],
        attempt=attempt,
    )


def device_checks_here():
    """Device and memory checks belong where extraction runs: this machine when jobs run
    locally, the extract job itself under a cluster executor (validate_env stays local).
    """
    return workflow.local_exec


def local_cores(wildcards):
    """workflow.cores when --cores is given (runs on this machine), else None."""
    if workflow.local_exec and workflow.global_resources["_cores"].value is not None:
        return workflow.cores
    return None


def extract_threads(wildcards):
    """Every core when jobs run locally (one engine at a time uses the whole machine); under
    a cluster executor, the job's CPUs (no --cores is given there)."""
    return local_cores(wildcards) or jobres.extract_cpus(EXTRACT)


def all_cores_or(n):
    """threads: every core locally, n CPUs per job on a cluster."""
    return lambda wildcards: local_cores(wildcards) or n


# Engine reuse on a cluster (docs/engine-reuse.md#on-slurm): extract jobs in group "extract"
# and regenerate_shard jobs in group "regenerate", N to an allocation with
# `--group-components extract=N regenerate=N --cores <CPUs of one extract job>`, run one after
# another there, the engine server started by the first serving the others (a capture server
# for extract jobs, a generate server for regenerate jobs: never one for both).
# Snakemake stacks a group's jobs (runtime summed, GPUs and CPUs of one job) only when two of
# them do not fit side by side in --cores; with more cores it asks for N times the GPUs.
# Local runs ignore groups.
SHARDS_PER_ALLOCATION = EXTRACT["shards_per_allocation"]
EXTRACT_GROUP = "extract" if SHARDS_PER_ALLOCATION > 1 else None
REGENERATE_GROUP = "regenerate" if SHARDS_PER_ALLOCATION > 1 else None


# Draft training (train.smk): draft.nodes x draft.processes_per_node ranks, asked for as SLURM
# tasks with their GPUs and CPUs; memory from the draft's memory plan; a runtime from the
# tokens to train at the rate this run measured (its progress.json), else
# draft.tokens_per_second_per_rank (eagleflow.plan.resources, docs/slurm.md).
TRAIN_JOB = trainres.TrainJob.from_settings(DRAFT_SETTINGS, EXTRACT)
TRAIN_SLURM = TRAIN_JOB.slurm()


def train_mpi(wildcards):
    """`srun` when the ranks start as the tasks of the job's SLURM allocation (more than one
    rank, under the cluster executor: where Snakemake submits the job, and in the job itself,
    whose Snakemake runs in remote mode); empty on this machine, where torchrun starts them.
    """
    if workflow.local_exec and not workflow.remote_exec:
        return ""
    return TRAIN_SLURM["mpi"]


def train_threads(wildcards):
    """Every core locally (shared by the ranks); on a cluster, every rank's CPUs of a node."""
    return (
        local_cores(wildcards) or TRAIN_JOB.cpus_per_rank * TRAIN_JOB.processes_per_node
    )


@cache
def training_tokens():
    """What one epoch trains (the token manifest: training samples' loss-masked tokens)."""
    import pandas as pd
    from eagleflow.data.heldout import excluder

    columns = ["sample_id", "n_tokens", "n_loss_tokens"]
    return trainres.TrainingTokens.from_manifest(
        pd.read_parquet(shard_manifest(), columns=columns),
        excluder(DRAFT_SETTINGS.heldout_modulus),
        DRAFT_SETTINGS.train.max_sample_tokens,
    )


def train_runtime(wildcards, attempt):
    """Minutes: epochs x the training tokens, at the rate this run's checkpoints measured
    (progress.json), else draft.tokens_per_second_per_rank, on every rank; x attempt."""
    progress = trainres.read_progress(f"{R}/draft/{wildcards.fp}/train.work")
    rate = trainres.measured_rate_per_rank(progress)
    return trainres.train_runtime_minutes(
        training_tokens().to_train(DRAFT_SETTINGS.train),
        rate or DRAFT_SETTINGS.ranks.tokens_per_second_per_rank,
        TRAIN_JOB.ranks,
        attempt,
    )


@cache
def train_memory_plan():
    """The draft's per-device memory plan at the target's shape and the longest pack (samples
    are at most data.max_length tokens), at the job's world size."""
    from eagleflow.draft.model import draft_config_for
    from eagleflow.train.memory_plan import Workload, plan_memory
    from eagleflow.target.head import read_target_config

    target = read_target_config(TARGET)
    cfg = DRAFT_SETTINGS.train
    draft = draft_config_for(
        target,
        min(DRAFT_SETTINGS.vocab_size, int(target["vocab_size"])),
        len(layer_ids()) - 1,
        **DRAFT_SETTINGS.model.overrides(),
    )
    longest = config["data"]["max_length"]
    if cfg.max_sample_tokens:
        longest = min(longest, cfg.max_sample_tokens)
    workload = Workload(
        max(cfg.max_tokens, longest),
        cfg.ttt_steps,
        TRAIN_JOB.ranks,
        TRAIN_JOB.device,
        cfg.sequence_parallel,
    )
    return plan_memory(draft, workload)


def train_mem_mb(wildcards):
    """Host memory per node: every rank's packs in flight, overhead, and on CPU its plan."""
    return trainres.host_mem_mb(
        train_memory_plan(),
        DRAFT_SETTINGS.train.num_workers,
        DRAFT_SETTINGS.train.prefetch_factor,
        TRAIN_JOB.processes_per_node,
    )


def evaluate_runtime(wildcards, attempt):
    """Minutes: a target load per evaluate.paths entry (the measured extraction load, else
    extract.model_load_minutes) and their greedy tokens at the measured regeneration rate,
    else data.regenerate.tokens_per_second; x attempt."""
    measured = measured_rates(wildcards.fp)
    load = (
        measured.load_seconds / 60
        if measured.load_seconds
        else EXTRACT["model_load_minutes"]
    )
    return trainres.evaluate_runtime_minutes(
        config["evaluate"],
        load,
        measured_regeneration().tokens_per_second or REGENERATE["tokens_per_second"],
        attempt,
    )
