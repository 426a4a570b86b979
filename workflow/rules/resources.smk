# Cluster resources, read by snakemake-executor-plugin-slurm (docs/slurm.md);
# on one machine only `threads` matters. The logic is in eagleflow.extract.resources.
import eagleflow.extract.resources as jobres

EXTRACT = config["extract"]


@cache
def target_weight_bytes():
    from eagleflow.target.info import weight_bytes

    return weight_bytes(read_target(TARGET))


@cache
def measured_rates(fp):
    """Throughput and load time measured by this extraction's finished shards (read once)."""
    return jobres.measured_rates(HIDDEN.format(fp=fp))


def extract_mem_mb(wildcards):
    return jobres.extract_mem_mb(EXTRACT, target_weight_bytes())


def extract_runtime(wildcards, input, attempt):
    tokens_per_second, engine_start_s = measured_rates(wildcards.fp)
    n_tokens = jobres.shard_tokens(input.tokens)
    return jobres.extract_runtime_minutes(
        n_tokens,
        tokens_per_second or EXTRACT["tokens_per_second"],
        engine_start_s / 60 if engine_start_s else EXTRACT["model_load_minutes"],
        jobres.verify_minutes(
            n_tokens, len(layer_ids()), read_target(TARGET).hidden_size
        ),
        attempt,
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
