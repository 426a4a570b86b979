import sys
from pathlib import Path

from eagleflow.capture.plan import CapturePlan, Strategy
from eagleflow.engine.settings import EngineSettings
from eagleflow.extract.client import ServerSpec, snakemake_ancestor
from eagleflow.extract.preflight import check_devices_for
from eagleflow.extract.shard import ShardOutputs, extract_shard
from eagleflow.logs import redirect_to_log
from eagleflow.store.verify import ShardInvalid


def engine_server(settings, plan, out) -> ServerSpec | None:
    """The shared engine server this job uses (docs/engine-reuse.md), or None for an engine of
    its own: reuse off, or vLLM's connector (its output directory is fixed per engine)."""
    ext = snakemake.config["extract"]
    if not ext["engine_reuse"] or plan.strategy is Strategy.EXTRACT_HIDDEN_STATES:
        return None
    return ServerSpec(
        settings,
        plan,
        engine_dir=Path(out.hidden).parent / ".engine",
        log_dir=Path(snakemake.log[0]).parent,
        idle_seconds=ext["engine_idle_seconds"],
        watch_pid=snakemake_ancestor(),
    )


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
                server=engine_server(settings, plan, out),
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
