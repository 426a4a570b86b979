import json

from eagleflow.draft.export import export_draft
from eagleflow.draft.train import load_trained
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    draft, ckpt = load_trained(snakemake.input.checkpoint)
    config = export_draft(
        draft,
        ckpt["aux_ids"],
        sorted(snakemake.input.shards),
        snakemake.params.target,
        snakemake.params.outdir,
        speculative_tokens=snakemake.params.speculative_tokens,
        provenance={
            "fingerprint": snakemake.wildcards.fp,
            "trained_steps": ckpt["step"],
            "vocab": ckpt["vocab"],
        },
    )
    print(json.dumps(config, indent=1))
