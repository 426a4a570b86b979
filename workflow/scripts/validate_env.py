import json
import sys

import pandas as pd

from eagleflow.extract.preflight import validate
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    total_tokens = int(
        pd.read_parquet(snakemake.input.manifest, columns=["n_tokens"])["n_tokens"].sum()
    )
    # Under a cluster executor this runs where Snakemake runs (often a login node without
    # GPUs): device and memory checks are then left to each extract job.
    device_checks = bool(snakemake.resources.get("device_checks", 1))
    ok, report = validate(
        snakemake.config,
        snakemake.params.target,
        total_tokens,
        snakemake.params.results_dir,
        device_checks=device_checks,
    )
    for check in report["checks"]:
        print(f"[{'ok' if check['ok'] else 'FAILED'}] {check['name']}: {check['detail']}")
    if not ok:
        failed = [c for c in report["checks"] if not c["ok"]]
        sys.exit("validate_env failed:\n" + "\n".join(f"- {c['detail']}" for c in failed))
    with open(snakemake.output[0], "w") as f:
        json.dump(report, f, indent=1)
