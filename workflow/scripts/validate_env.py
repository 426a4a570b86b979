import json
import sys

import pandas as pd

from eagleflow.data.heldout import excluder
from eagleflow.evaluate.sets import check_sets
from eagleflow.extract.preflight import validate
from eagleflow.logs import redirect_to_log
from eagleflow.plan.resources import TrainingTokens
from eagleflow.plan.settings import DraftSettings
from eagleflow.plan.stream_cost import configured_states_cost

with redirect_to_log(snakemake.log[0]):
    config = snakemake.config
    draft = DraftSettings.from_config(config)
    manifest = pd.read_parquet(
        snakemake.input.manifest, columns=["sample_id", "n_tokens", "n_loss_tokens"]
    )
    total_tokens = int(manifest["n_tokens"].sum())
    # An epoch's training samples, for what the draft.states mode costs (as `progress` counts).
    training = TrainingTokens.from_manifest(
        manifest,
        excluder(draft.heldout_modulus),
        draft.train.max_sample_tokens,
    )
    # Under a cluster executor this runs where Snakemake runs (often a login node without
    # GPUs): device and memory checks are then left to each extract job.
    device_checks = bool(snakemake.resources.get("device_checks", 1))
    ok, report = validate(
        config,
        snakemake.params.target,
        total_tokens,
        snakemake.params.results_dir,
        device_checks=device_checks,
        states_cost=lambda per_token: configured_states_cost(
            draft, config["extract"], total_tokens, per_token, training
        ),
    )
    # The evaluation's prompt sets: a missing or malformed file stops the run now, not after
    # the draft is trained.
    sets_ok, sets_detail = check_sets(config)
    report["checks"].append({"name": "evaluate_sets", "ok": sets_ok, "detail": sets_detail})
    ok = report["ok"] = ok and sets_ok
    for check in report["checks"]:
        print(f"[{'ok' if check['ok'] else 'FAILED'}] {check['name']}: {check['detail']}")
    for line in report.get("states_cost", {}).get("lines", []):
        print(f"[cost] {line}")
    if not ok:
        failed = [c for c in report["checks"] if not c["ok"]]
        sys.exit("validate_env failed:\n" + "\n".join(f"- {c['detail']}" for c in failed))
    with open(snakemake.output[0], "w") as f:
        json.dump(report, f, indent=1)
