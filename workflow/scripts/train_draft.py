import json
import shutil
from pathlib import Path

from eagleflow.draft.train import CHECKPOINT, CURVES, METRICS, TrainConfig, train
from eagleflow.draft.vocab import load_vocab
from eagleflow.logs import redirect_to_log

# The trainer works in params.workdir (not a declared output, so Snakemake never deletes it
# after a crash) and resumes from its checkpoint there; the outputs are copied at the end.
with redirect_to_log(snakemake.log[0]):
    work = Path(snakemake.params.workdir)
    settings = dict(snakemake.params.train)
    cfg = TrainConfig(
        **{k: v for k, v in settings.items() if k in TrainConfig.__dataclass_fields__}
    )
    summary = train(
        sorted(snakemake.input.shards),
        snakemake.params.target,
        load_vocab(snakemake.input.vocab),
        work,
        cfg,
    )
    print(json.dumps(summary, indent=1, default=str))
    for name, out in (
        (CHECKPOINT, snakemake.output.checkpoint),
        (METRICS, snakemake.output.metrics),
        (CURVES, snakemake.output.curves),
    ):
        shutil.copyfile(work / name, out)
