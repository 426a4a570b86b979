import json

import pandas as pd

from eagleflow.extract.progress import (
    extraction_progress,
    format_progress,
    format_regeneration_plan,
    regeneration_plan,
)
from eagleflow.logs import redirect_to_log
from eagleflow.plan.progress import format_training_progress, training_progress
from eagleflow.plan.settings import DraftSettings
from eagleflow.plan.stream_cost import TRAINER_ASSUMED, StatesCost, engine_rate
from eagleflow.store.quant import bytes_per_token

parts = []
if "sources" in snakemake.input.keys():
    with open(snakemake.input.sources) as f:
        sources = json.load(f)
    parts.append(
        format_regeneration_plan(
            regeneration_plan(
                sources, snakemake.params.regenerated_dir, snakemake.params.max_new_tokens
            )
        )
    )
ext = snakemake.params.extraction
if ext is None:
    parts.append("extraction: planned once every source shard is regenerated and sharded")
else:
    progress = extraction_progress(
        pd.read_parquet(snakemake.input.manifest),
        ext["hidden_dir"],
        len(ext["layer_ids"]),
        ext["hidden_size"],
        snakemake.params.dtype,
        snakemake.params.storage_dtype,
    )
    parts.append(format_progress(progress))
training = snakemake.params.training
if training is not None:
    columns = ["sample_id", "n_tokens", "n_loss_tokens"]
    draft = DraftSettings.from_config(snakemake.config)
    plan = training_progress(
        pd.read_parquet(snakemake.input.manifest, columns=columns),
        training["work_dir"],
        draft,
        training["ranks"],
    )
    parts.append(format_training_progress(plan))
    # What the states cost in the run's draft.states mode: bytes on disk, target prefill-hours,
    # and the training rate when the engine is slower than the trainer.
    rate, source = engine_rate(snakemake.config["extract"], progress["measured_tokens_per_second"])
    per_rank, ranks = plan["tokens_per_second_per_rank"], plan["ranks"]
    measured = "measured by this run's checkpoints" if plan["rate_measured"] else TRAINER_ASSUMED
    cost = StatesCost.from_settings(
        draft,
        tokens_per_epoch=plan["prefill_tokens_per_epoch"],
        loss_tokens_per_epoch=plan["tokens_per_epoch"],
        extracted_tokens=progress["tokens_total"],
        bytes_per_token=bytes_per_token(
            len(ext["layer_ids"]),
            ext["hidden_size"],
            snakemake.params.dtype,
            snakemake.params.storage_dtype,
        ),
        engine_tokens_per_second=rate,
        trainer_tokens_per_second=per_rank * ranks,
        engine_source=source,
        trainer_source=f"{per_rank:,.0f} per rank x {ranks} rank(s), {measured}",
    )
    parts.extend(cost.lines())
text = "\n".join(parts)
print(text)  # to the terminal: this target exists to be read
with redirect_to_log(snakemake.log[0]):
    print(text)
