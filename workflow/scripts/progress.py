import pandas as pd

from eagleflow.extract.progress import extraction_plan, format_plan
from eagleflow.logs import redirect_to_log

progress = extraction_plan(
    pd.read_parquet(snakemake.input.manifest),
    snakemake.params.hidden_dir,
    len(snakemake.params.layer_ids),
    snakemake.params.hidden_size,
    snakemake.params.dtype,
)
text = format_plan(progress)
print(text)  # to the terminal: this target exists to be read
with redirect_to_log(snakemake.log[0]):
    print(text)
