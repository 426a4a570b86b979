import json
import sys

from eagleflow.capture import plan_path
from eagleflow.logs import redirect_to_log
from eagleflow.shards import read_token_shard
from eagleflow.verify import verify_shard

with redirect_to_log(snakemake.log[0]):
    with open(plan_path(snakemake.config["results_dir"], snakemake.wildcards.fp)) as f:
        plan = json.load(f)
    with open(snakemake.input.record) as f:
        record = json.load(f)
    result = verify_shard(
        snakemake.input.hidden, read_token_shard(snakemake.input.tokens), record, snakemake.wildcards.fp,
        plan["layer_ids"], plan["hidden_size"], snakemake.params.dtype,
    )
    print(json.dumps(result, indent=1))
    if not result["ok"]:
        sys.exit(f"shard {result['shard_id']} ({result['path']}) failed verification: " + "; ".join(result["problems"]))
    with open(snakemake.output[0], "w") as f:
        json.dump(result, f, indent=1)
