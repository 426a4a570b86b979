import json

from eagleflow.engine.settings import EngineSettings
from eagleflow.evaluate.acceptance import EvalSettings, evaluate
from eagleflow.logs import redirect_to_log
from eagleflow.serve.client import release_idle_servers, this_run

with redirect_to_log(snakemake.log[0]):
    import torch

    # An engine server of this run still idling (docs/engine-reuse.md) frees the devices first.
    release_idle_servers(this_run())

    torch.set_num_threads(snakemake.threads)
    report = evaluate(
        EngineSettings.from_config(snakemake.config, "evaluate"),
        snakemake.params.export,
        snakemake.input.dataset,
        EvalSettings.from_config(snakemake.config),
        (snakemake.output.result, snakemake.output.plot, snakemake.output.table),
        workdir=snakemake.params.workdir,
        log=lambda line: print(line, flush=True),
    )
    print(
        json.dumps(
            {
                f"{name} k={k}": {p: r.get("acceptance_length") for p, r in results.items()}
                for name, by_k in report["runs"].items()
                for k, results in by_k.items()
            }
        )
    )
