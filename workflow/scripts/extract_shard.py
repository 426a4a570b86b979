import json
import sys

from eagleflow.capture.plan import plan_path
from eagleflow.extract.shard import EngineSettings, extract_shard
from eagleflow.logs import redirect_to_log
from eagleflow.store.verify import ShardInvalid


def check_devices_here(settings, ext):
    """Device and memory checks where the job runs (validate_env may have run on a login node),
    for the configured device: a job given GPUs by SLURM still runs on `extract.device`."""
    from eagleflow.extract.preflight import check_devices
    from eagleflow.target.info import bytes_per_weight, count_parameters, read_target

    info = read_target(settings.target)
    weight_bytes = int(count_parameters(info) * bytes_per_weight(info.text_config))
    checks = check_devices(
        settings.device,
        settings.tensor_parallel_size,
        weight_bytes,
        ext["cpu_kvcache_space_gib"],
        ext["gpu_memory_utilization"],
    )
    for check in checks:
        print(f"[{'ok' if check.ok else 'FAILED'}] {check.name}: {check.detail}")
    failed = [c.detail for c in checks if not c.ok]
    if failed:
        sys.exit(failed[0])


def main():
    ext = snakemake.config["extract"]
    settings = EngineSettings(
        target=snakemake.config["target"]["path"],
        device=ext["device"],
        tensor_parallel_size=ext["tensor_parallel_size"],
        dtype=ext["dtype"],
        max_model_len=snakemake.config["data"]["max_length"] + 1,
        max_num_batched_tokens=ext["max_num_batched_tokens"],
        max_num_seqs=ext["max_num_seqs"],
        gpu_memory_utilization=ext["gpu_memory_utilization"],
        cpu_kvcache_space_gib=ext["cpu_kvcache_space_gib"],
        cpu_threads_bind=ext["cpu_threads_bind"],
    )
    with open(plan_path(snakemake.config["results_dir"], snakemake.wildcards.fp)) as f:
        plan = json.load(f)
    with redirect_to_log(snakemake.log[0]):
        check_devices_here(settings, ext)
        try:
            record = extract_shard(
                snakemake.input.tokens,
                plan,
                snakemake.wildcards.fp,
                snakemake.output.hidden,
                snakemake.output.record,
                snakemake.output.report,
                settings,
                chunk_tokens=ext["chunk_tokens"],
            )
        except ShardInvalid as e:
            sys.exit(str(e))
        print(
            f"shard {record['shard_id']}: {record['n_tokens']} tokens, "
            f"{record['tokens_per_second']} tok/s, {record['bytes']} bytes, model loaded: {record['model_loaded']}"
        )


# vLLM starts worker processes: the guard keeps them from re-running this script.
if __name__ == "__main__":
    main()
