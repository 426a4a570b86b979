# Cluster resources, read by snakemake-executor-plugin-slurm (docs/slurm.md);
# on one machine only `threads` matters. The logic is in eagleflow.extract.resources, the
# measured rates in eagleflow.extract.rates (as `snakemake progress` reads them).
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
