import json

from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    with open(snakemake.output[0], "w") as f:
        json.dump(snakemake.params.record, f, indent=1, sort_keys=True)
    print(f"wrote {snakemake.output[0]}")
