import sys
from pathlib import Path

from eagleflow.capture.plan import CapturePlan
from eagleflow.engine.settings import EngineSettings
from eagleflow.extract.preflight import check_devices_for
from eagleflow.extract.shard import ShardOutputs, extract_shard
from eagleflow.logs import redirect_to_log
from eagleflow.serve.client import engine_server
from eagleflow.store.verify import ShardInvalid


def main():
    out = snakemake.output
    outputs = ShardOutputs(Path(out.hidden), Path(out.record), Path(out.report))
    with redirect_to_log(snakemake.log[0]):
        settings = EngineSettings.from_config(snakemake.config, "extract")
        plan = CapturePlan.load(snakemake.input.plan)
        # Where the job runs (validate_env may have run on a login node without GPUs).
        check_devices_for(settings)
        try:
            record = extract_shard(
                snakemake.input.tokens,
                plan,
                outputs,
                settings,
                chunk_tokens=snakemake.config["extract"]["chunk_tokens"],
                # The shared capture server (docs/engine-reuse.md), or None for its own engine.
                server=engine_server(
                    snakemake.config, settings, plan, out.hidden, snakemake.log[0]
                ),
            )
        except ShardInvalid as e:
            sys.exit(str(e))
        print(
            f"shard {record['shard_id']}: {record['n_tokens']} tokens, "
            f"{record['tokens_per_second']} tok/s, {record['bytes']} bytes, "
            f"model loaded: {record['model_loaded']}, engine: {record['engine']}"
        )


# vLLM starts worker processes: the guard keeps them from re-running this script.
if __name__ == "__main__":
    main()
