import json

from eagleflow.draft.acceptance import evaluate
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    import torch

    torch.set_num_threads(snakemake.threads)
    cfg = snakemake.params.cfg
    report = evaluate(
        snakemake.params.target,
        snakemake.params.export,
        snakemake.input.dataset,
        snakemake.output.result,
        snakemake.output.plot,
        k=cfg["speculative_tokens"],
        max_tokens=cfg["max_tokens"],
        num_prompts=cfg["num_prompts"],
        modulus=snakemake.params.heldout_modulus,
        paths=cfg["paths"],
        no_mla=not cfg["mla"],
        workdir=snakemake.params.workdir,
    )
    print(json.dumps({n: r.get("acceptance_length") for n, r in report["results"].items()}))
