import pandas as pd

from eagleflow.logs import redirect_to_log
from eagleflow.planning import extraction_plan, format_plan

plan = extraction_plan(
    pd.read_parquet(snakemake.input.manifest), snakemake.params.hidden_dir, len(snakemake.params.layer_ids),
    snakemake.params.hidden_size, snakemake.params.dtype,
)
text = format_plan(plan)
print(text)  # to the terminal: this target exists to be read
with redirect_to_log(snakemake.log[0]):
    print(text)
