import json

from eagleflow.capture.plan import CapturePlan
from eagleflow.draft.weights import load_trained
from eagleflow.export.speculators_format import export_draft
from eagleflow.logs import redirect_to_log

# input.best: the trainer's `best/` (the draft with the best simulated acceptance length);
# its frozen embedding is read again from the target.
with redirect_to_log(snakemake.log[0]):
    draft, meta = load_trained(snakemake.input.best, target_dir=snakemake.params.target)
    config = export_draft(
        draft,
        meta["aux_ids"],
        sorted(snakemake.input.shards),
        snakemake.params.target,
        snakemake.params.outdir,
        speculative_tokens=snakemake.params.speculative_tokens,
        provenance={
            "fingerprint": snakemake.wildcards.fp,
            "trained_steps": meta["step"],
            "simulated_acceptance_length": meta["simulated_acceptance_length"],
            "vocab": meta["vocab"],
        },
        # draft.states stream | cached: the token shards, and the capture plan's layer ids
        layer_ids=CapturePlan.load(snakemake.input.plan).layer_ids
        if snakemake.input.get("plan")
        else None,
    )
    print(json.dumps(config, indent=1))
