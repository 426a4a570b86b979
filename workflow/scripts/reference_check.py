import json
import sys
from dataclasses import asdict

import pandas as pd
from safetensors import safe_open

from eagleflow.capture.reference import check_shard_against_reference, load_reference_model
from eagleflow.logs import redirect_to_log
from eagleflow.store.quant import ShardStates

with redirect_to_log(snakemake.log[0]):
    model = load_reference_model(snakemake.params.target, device=snakemake.params.device)
    rows = []
    for path in snakemake.input.shards:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            offsets = f.get_tensor("offsets").numpy()
            n = len(offsets) - 1
            step = max(1, n // snakemake.params.samples_per_shard)
            samples = list(range(0, n, step))[: snakemake.params.samples_per_shard]
            stats = check_shard_against_reference(
                model,
                ShardStates(f, path),  # only the sampled rows read; fp8 dequantized
                f.get_tensor("input_ids").numpy(),
                offsets,
                json.loads(meta["layer_ids"]),
                samples,
            )
        rows += [
            {
                "shard_id": meta["shard_id"],
                "storage_dtype": meta.get("storage_dtype", "bfloat16"),
                "samples": len(samples),
                **asdict(s),
                "ok": s.ok,
            }
            for s in stats
        ]
    table = pd.DataFrame(rows)
    table.to_csv(snakemake.output.table, sep="\t", index=False)
    print(table.to_string(index=False))
    if not table["ok"].all():
        bad = table[~table["ok"]]
        sys.exit(
            "reference_check: captured states differ from the reference: "
            + "; ".join(
                f"shard {r.shard_id} layer {r.layer_id}: median rel err {r.median_rel_err:.3f}, "
                f"cosine {r.mean_cosine:.4f}, closer to its own layer than the next on "
                f"{r.closer_to_own:.0%} of tokens"
                for r in bad.itertuples()
            )
        )
