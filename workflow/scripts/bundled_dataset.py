from eagleflow.embedded.bundled_data import bundled_rows, write_jsonl
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    data = snakemake.params.data
    rows = bundled_rows(data)
    write_jsonl(rows, snakemake.output[0])
    print(f"wrote {len(rows)} conversations ({data['bundled_corpus']}) to {snakemake.output[0]}")
