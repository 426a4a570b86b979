import json

import pandas as pd

from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    rows = []
    for report_path in snakemake.input.reports:
        with open(report_path) as f:
            report = json.load(f)
        rows.append(
            {
                "shard_id": report["shard_id"],
                "ok": report["ok"],
                "n_samples": report["n_samples"],
                "n_tokens": report["n_tokens"],
                "bytes": report["bytes"],
                "sha256": report["sha256"],
                "tokens_per_second": report["tokens_per_second"],
                "problems": "; ".join(report["problems"]),
            }
        )
    table = pd.DataFrame(rows)
    table.to_csv(snakemake.output.table, sep="\t", index=False)
    table.to_parquet(snakemake.output.manifest, index=False)
    print(table.to_string(index=False))
    print(
        f"{len(table)} shards, {int(table['n_tokens'].sum())} tokens, all verified: "
        f"{bool(table['ok'].all())}"
    )
