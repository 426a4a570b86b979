import os
import shutil
import subprocess
import sys
from pathlib import Path

from eagleflow.draft.vocab import load_vocab
from eagleflow.logs import UserError, redirect_to_log
from eagleflow.plan import launch
from eagleflow.plan.settings import DraftSettings
from eagleflow.serve.client import stop_server
from eagleflow.train.checkpoint import BEST
from eagleflow.train.memory_plan import MemoryPlanError
from eagleflow.train.preflight import launch_for_job, preflight
from eagleflow.train.records import CURVES, METRICS, SUMMARY, VALIDATION
from eagleflow.train.states import StreamSource, state_source

# Starts draft.nodes x draft.processes_per_node trainer ranks (eagleflow.plan.launch): with
# torchrun on this machine, or one srun task per rank inside the job's SLURM allocation (its
# resources hold `mpi`). The trainer works in params.workdir (not a declared output, so
# Snakemake never deletes it after a crash) and resumes from its latest checkpoint there; the
# outputs are copied at the end: `best` (the directory export reads), metrics, validation,
# curves, summary. With draft.states stream or cached, `shards` are the token shards and the
# states come from the shared capture server (eagleflow.train.states), which this job asks
# to stop once the trainer has finished, freeing its devices for the evaluate job.
FILES = {"best": BEST, "metrics": METRICS, "validation": VALIDATION, "curves": CURVES}
FILES["summary"] = SUMMARY

with redirect_to_log(snakemake.log[0]):
    config = snakemake.config
    work = Path(snakemake.params.workdir)
    shards = sorted(snakemake.input.shards)
    stream = None
    try:
        draft = DraftSettings.from_config(config)
        if not draft.states.stored:
            fp = snakemake.wildcards.fp
            stream = StreamSource.for_job(
                config,
                draft.states,
                snakemake.input.plan,
                Path(config["results_dir"]) / "logs" / "extract" / fp / "stream.log",
            )
        run = launch_for_job(
            draft,
            config["extract"],
            srun=bool(snakemake.resources.get("mpi")),
            threads=snakemake.threads,
        )
        preflight(
            state_source(shards, stream),
            snakemake.params.target,
            load_vocab(snakemake.input.vocab),
            draft.train,
            draft.model.overrides(),
            run,
            log=lambda line: None,  # the trainer logs the plan; a refusal is the sentence
        )
    except (launch.LaunchError, MemoryPlanError, ValueError) as e:
        raise UserError(str(e)) from None
    args = launch.trainer_args(
        shards, snakemake.params.target, snakemake.input.vocab, work, draft, stream
    )
    cmd = launch.command(run, args)
    launcher = cmd.argv[: len(cmd.argv) - len(args)]
    print(f"{run.world_size} rank(s): {' '.join(launcher)} <trainer arguments>", flush=True)
    try:
        proc = subprocess.run(cmd.argv, env={**os.environ, **cmd.env})
    finally:
        if stream is not None:  # finished, failed or interrupted: free the engine's devices
            stop_server(stream.server)
    if proc.returncode:
        sys.exit(
            f"the trainer exited with status {proc.returncode} (its ranks' output is above); "
            f"a rerun resumes from the latest checkpoint in {work}"
        )
    for name, out in snakemake.output.items():
        source = work / FILES[name]
        if source.is_dir():
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(source, out)
        else:
            shutil.copyfile(source, out)
