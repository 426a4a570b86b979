import json

import pandas as pd

from eagleflow.draft.progress import format_training_progress, training_progress
from eagleflow.extract.progress import (
    extraction_progress,
    format_progress,
    format_regeneration_plan,
    regeneration_plan,
)
from eagleflow.logs import redirect_to_log

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
    plan = training_progress(
        pd.read_parquet(snakemake.input.manifest, columns=columns),
        training["work_dir"],
        snakemake.params.draft,
        training["ranks"],
        training["heldout_modulus"],
    )
    parts.append(format_training_progress(plan))
text = "\n".join(parts)
print(text)  # to the terminal: this target exists to be read
with redirect_to_log(snakemake.log[0]):
    print(text)
