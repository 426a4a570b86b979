import json

import pandas as pd

from eagleflow.extract.progress import (
    extraction_plan,
    format_plan,
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
    plan = extraction_plan(
        pd.read_parquet(snakemake.input.manifest),
        ext["hidden_dir"],
        len(ext["layer_ids"]),
        ext["hidden_size"],
        snakemake.params.dtype,
    )
    parts.append(format_plan(plan))
text = "\n".join(parts)
print(text)  # to the terminal: this target exists to be read
with redirect_to_log(snakemake.log[0]):
    print(text)
