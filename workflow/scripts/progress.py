import pandas as pd

from eagleflow.extract.progress import extraction_progress, format_progress
from eagleflow.logs import redirect_to_log

progress = extraction_progress(
    pd.read_parquet(snakemake.input.manifest),
    snakemake.params.hidden_dir,
    len(snakemake.params.layer_ids),
    snakemake.params.hidden_size,
    snakemake.params.dtype,
    snakemake.params.storage_dtype,
)
text = format_progress(progress)
print(text)  # to the terminal: this target exists to be read
with redirect_to_log(snakemake.log[0]):
    print(text)
