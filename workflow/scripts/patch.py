from dataclasses import replace

from eagleflow.capture.plan import make_plan
from eagleflow.logs import redirect_to_log
from eagleflow.target.info import read_target
from eagleflow.target.layers import resolve_layer_ids

with redirect_to_log(snakemake.log[0]):
    info = read_target(snakemake.params.target)
    cap = snakemake.params.capture
    ids = resolve_layer_ids(cap["layer_ids"], cap["layer_id_convention"], info.num_layers)
    # The device decides whether extract_hidden_states can work (CUDA only); the pipeline
    # layout, which stage captures which ids (an extract job re-plans if it changes). The
    # storage dtype is read from the config, not a param: it is in the fingerprint (the output's
    # path), and the default must not re-run the plans of existing extractions.
    ext = snakemake.config["extract"]
    plan = make_plan(
        info,
        ids,
        cap["strategy"],
        device=ext["device"],
        pipeline_parallel_size=ext["pipeline_parallel_size"],
        storage_dtype=snakemake.config["capture"]["storage_dtype"],
    )
    plan = replace(plan, fingerprint=snakemake.wildcards.fp)
    plan.save(snakemake.output[0])
    print(
        f"capture plan: strategy {plan.strategy.value}, layer ids {plan.layer_ids} "
        f"({plan.layer_id_convention}), stored as {plan.storage_dtype}"
    )
    for check in plan.checks_passed:
        print(f"[ok] {check}")
