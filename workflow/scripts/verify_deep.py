import json
import sys

import pandas as pd

from eagleflow.capture.plan import CapturePlan
from eagleflow.data.shards import read_token_shard
from eagleflow.logs import redirect_to_log
from eagleflow.store.verify import Expected, verify_shard

with redirect_to_log(snakemake.log[0]):
    plan = CapturePlan.load(snakemake.input.plan)
    rows = []
    for data, record_path, tokens in zip(
        snakemake.input.shards, snakemake.input.records, snakemake.input.tokens
    ):
        with open(record_path) as f:
            record = json.load(f)
        rows.append(
            verify_shard(
                data,
                read_token_shard(tokens),
                record,
                Expected.of(plan, snakemake.params.dtype),
                deep=True,
            )
        )
    table = pd.DataFrame(rows)
    print(table[["shard_id", "ok", "n_tokens", "bytes", "problems"]].to_string(index=False))
    bad = table[~table["ok"]]
    if len(bad):
        sys.exit(
            "verify_deep: "
            + "; ".join(
                f"shard {r.shard_id} ({r.path}): {'; '.join(r.problems)}" for r in bad.itertuples()
            )
        )
    print(f"verify_deep: all {len(table)} shards re-hashed and verified")
