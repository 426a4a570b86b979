import json

from eagleflow.extract import EngineSettings, extract_shard
from eagleflow.logs import redirect_to_log


def main():
    ext = snakemake.config["extract"]
    settings = EngineSettings(
        target=snakemake.params.target,
        device=ext["device"],
        tensor_parallel_size=ext["tensor_parallel_size"],
        dtype=ext["dtype"],
        max_model_len=snakemake.config["data"]["max_length"] + 1,
        max_num_batched_tokens=ext["max_num_batched_tokens"],
        gpu_memory_utilization=ext["gpu_memory_utilization"],
        cpu_kvcache_space_gib=ext["cpu_kvcache_space_gib"],
        cpu_threads_bind=ext["cpu_threads_bind"],
    )
    with open(snakemake.input.plan) as f:
        plan = json.load(f)
    with redirect_to_log(snakemake.log[0]):
        record = extract_shard(
            snakemake.input.tokens, plan, snakemake.wildcards.fp, snakemake.output.hidden, settings,
            chunk_tokens=ext["chunk_tokens"],
        )
        tmp = snakemake.output.record + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        import os

        os.replace(tmp, snakemake.output.record)
        print(
            f"shard {record['shard_id']}: {record['n_tokens']} tokens, "
            f"{record['tokens_per_second']} tok/s, {record['bytes']} bytes, model loaded: {record['model_loaded']}"
        )


# vLLM starts worker processes: the guard keeps them from re-running this script.
if __name__ == "__main__":
    main()
