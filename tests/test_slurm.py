"""`snakemake --profile slurm` against a real single-node SLURM on loopback
(tests/slurm/cluster.sh): the embedded default goes through sbatch, a damaged shard fails its
job (retried with more time, then reported with its log), a rerun after the fix runs only what
failed, and a final rerun submits nothing. CPU regeneration and extraction run inside jobs that
were given (fake) GPUs; train_draft runs as one job of 2 tasks, one rank each.

Needs root and apt (the cluster script installs SLURM); if the cluster cannot come up, the
tests fail. Marked `slurm` and left out of a quick run: the whole default runs as jobs."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from support.workflow_runner import (
    CHILD_ENV,
    REPO,
    SHORT_REGENERATION,
    SMALL,
    SNAKEMAKE,
    merged,
    write_config,
)

pytestmark = pytest.mark.slurm

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
PARTITION = ACCOUNT = "eagleflow-test"
# 2 shards (one good, one damaged: enough for every claim, and each extract job costs an
# engine start); each extract job asks for 4 of the node's 8 fake GPUs and (up to) 2 CPUs, and
# still extracts on the CPU (extract.device stays cpu).
N_SHARDS = 2
CONFIG = merged(
    SMALL,
    {
        "data": {
            "bundled_conversations": 100 * N_SHARDS,
            # one regenerate_shard job (one source shard of all rows, cut into the token
            # shards after), short replies
            "regenerate": {
                **SHORT_REGENERATION,
                "shard_rows": 100 * N_SHARDS,
                "chunk_rows": 50,
                "tokens_per_second": 20,
            },
        },
        "extract": {
            "gpus_per_job": 4,
            "cpus_per_job": min(2, os.cpu_count() or 1),
            "model_load_minutes": 3,
            "tokens_per_second": 300,  # generous limits on a busy machine
            # as a user's cluster runs it: an allocation's server stops soon after its jobs
            "engine_idle_seconds": 60,
        },
    },
)
# A group job is named by a UUID, a single job by its number.
SUBMITTED = re.compile(r"Job \S+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.")


@pytest.fixture(scope="session")
def slurm_cluster():
    up = subprocess.run(["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=1200)
    assert up.returncode == 0, (
        f"the test SLURM cluster did not come up:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
    )
    yield
    down = subprocess.run(
        ["bash", str(CLUSTER), "down"], capture_output=True, text=True, timeout=300
    )
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(scope="module")
def profile_home(tmp_path_factory):
    """A fresh user config directory in which envs/link-slurm-profile.sh (run by
    envs/setup-cpu.sh) links `snakemake/slurm` to profiles/slurm, as on a user's machine."""
    home = tmp_path_factory.mktemp("xdg-config")
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    link = ["bash", str(REPO / "envs" / "link-slurm-profile.sh")]
    subprocess.run(link, check=True, env=env, timeout=60)
    assert (home / "snakemake" / "slurm").resolve() == REPO / "profiles" / "slurm"
    return home


def snakemake_slurm(workdir: Path, profile_home: Path, *args, timeout=1200, config=CONFIG):
    """Exactly `snakemake --profile slurm` from the repository root (the profile is found in
    the user config directory), in a scratch directory with the test config."""
    configfile = write_config(workdir, config)
    # Targets first: --configfile takes several values.
    cmd = [
        "timeout",
        "-k",
        "30",
        str(timeout),
        SNAKEMAKE,
        *args,
        "--profile",
        "slurm",
        "--directory",
        str(workdir),
        "--configfile",
        str(configfile),
    ]
    env = {
        **os.environ,
        **CHILD_ENV,  # the jobs inherit it (sbatch exports the submitter's environment)
        "XDG_CONFIG_HOME": str(profile_home),
        "EAGLEFLOW_SLURM_PARTITION": PARTITION,
        "EAGLEFLOW_SLURM_ACCOUNT": ACCOUNT,
    }
    t0 = time.time()
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout + 60
    )
    proc.seconds = time.time() - t0
    proc.out = proc.stdout + proc.stderr
    proc.submitted = [(int(j), log) for j, log in SUBMITTED.findall(proc.out)]
    return proc


def job_stats(out: str) -> dict:
    """{rule: count} of the first 'Job stats' table of a run."""
    counts = {}
    block = out.split("Job stats:", 1)[1] if "Job stats:" in out else ""
    for line in block.splitlines()[3:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        counts[parts[0]] = int(parts[1])
    counts.pop("total", None)
    return counts


def sacct(job_ids) -> dict:
    out = subprocess.run(
        [
            "sacct",
            "-X",
            "-n",
            "-P",
            "-j",
            ",".join(map(str, job_ids)),
            "-o",
            "JobID,State,Timelimit,AllocTRES,Account,Partition",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return {
        int(r[0]): {
            "state": r[1],
            "timelimit": r[2],
            "tres": r[3],
            "account": r[4],
            "partition": r[5],
        }
        for r in rows
    }


def fail_msg(proc) -> str:
    return f"rc {proc.returncode} after {proc.seconds:.0f} s:\n{proc.out[-6000:]}"


@pytest.fixture(scope="module")
def runs(slurm_cluster, profile_home, tmp_path_factory):
    """Shard; damage one token shard; run (fails); repair; rerun; rerun again."""
    workdir = tmp_path_factory.mktemp("slurm-run")
    t0 = time.time()
    runs = {"workdir": workdir}

    runs["shard"] = p = snakemake_slurm(workdir, profile_home, "results/shards/manifest.parquet")
    assert p.returncode == 0, fail_msg(p)

    manifest = pd.read_parquet(workdir / "results" / "shards" / "manifest.parquet")
    runs["shards"] = shards = sorted(manifest["shard_id"].unique())
    assert len(shards) == N_SHARDS
    # The damaged shard: its header is intact, its data cut off (a truncated copy).
    runs["bad"] = bad = shards[0]
    tokens = workdir / "results" / "shards" / "tokens" / f"{bad}.safetensors"
    good_bytes = tokens.read_bytes()
    header_len = 8 + int.from_bytes(good_bytes[:8], "little")
    with open(tokens, "r+b") as f:
        f.truncate(header_len + 16)

    # `extract`: the extraction chain is what runs on GPU nodes (draft training runs through
    # SLURM in its own test below).
    runs["failed"] = p = snakemake_slurm(workdir, profile_home, "extract")
    assert p.returncode != 0, fail_msg(p)

    with open(tokens, "r+b") as f:  # repaired in place
        f.write(good_bytes)

    runs["fixed"] = p = snakemake_slurm(workdir, profile_home, "extract")
    assert p.returncode == 0, fail_msg(p)
    runs["again"] = p = snakemake_slurm(workdir, profile_home, "extract")
    assert p.returncode == 0, fail_msg(p)
    print(
        "SLURM test runs: "
        + ", ".join(f"{k} {runs[k].seconds:.0f} s" for k in ("shard", "failed", "fixed", "again"))
        + f"; total {time.time() - t0:.0f} s"
    )
    return runs


def hidden_dir(workdir: Path) -> Path:
    (fp_dir,) = [p for p in (workdir / "results" / "hidden").iterdir() if p.is_dir()]
    return fp_dir


def test_jobs_run_through_slurm_with_their_resources(runs):
    submitted = [j for k in ("shard", "failed", "fixed") for j in runs[k].submitted]
    assert submitted, "no job was submitted to SLURM"
    for job_id, log in submitted:  # every job's SLURM log is kept, named by its job id
        assert Path(log).is_file() and Path(log).name == f"{job_id}.log", log
    records = sacct([j for j, _ in submitted])
    assert set(records) == {j for j, _ in submitted}, "sacct lacks records of submitted jobs"
    assert all(r["account"] == ACCOUNT and r["partition"] == PARTITION for r in records.values())
    extract = [j for j, log in submitted if "/rule_extract_shard/" in log]
    good = [j for j in extract if records[j]["state"] == "COMPLETED"]
    assert len(good) == N_SHARDS
    for j in good:  # asked for GPUs (fake here) and got them, yet extracted on the CPU
        assert "gres/gpu=4" in records[j]["tres"] and "node=1" in records[j]["tres"], records[j]
    rules_submitted = {
        next(part for part in Path(log).parts if part.startswith("rule_")) for _, log in submitted
    }
    assert rules_submitted == {
        "rule_regenerate_shard",
        "rule_shard",
        "rule_patch",
        "rule_extract_shard",
    }
    # the regeneration job of the one source shard, given the extract jobs' GPUs, its time limit
    # sized from its prompts (user turns x max_new_tokens at 20 tok/s, plus the 3-minute load)
    from eagleflow.extract.resources import extract_runtime_minutes

    sources = json.loads((runs["workdir"] / "results/regenerated/sources.json").read_text())
    prompts = {s["id"]: s["prompts"] for s in sources["shards"]}
    regen = {j: log for j, log in submitted if "/rule_regenerate_shard/" in log}
    assert len(regen) == 1
    for j, log in regen.items():
        (source,) = [s for s in prompts if f"/{s}/" in log]
        assert records[j]["state"] == "COMPLETED" and "gres/gpu=4" in records[j]["tres"]
        limit = extract_runtime_minutes(prompts[source] * 8, 20, 3)
        assert records[j]["timelimit"] == f"00:{limit:02d}:00", (records[j], limit)
    workdir = runs["workdir"]
    fp = hidden_dir(workdir).name
    log = (workdir / "results" / "logs" / "extract" / fp / f"{runs['shards'][1]}.log").read_text()
    assert "[ok] devices:" in log and "CPU cores for tensor_parallel_size=1" in log
    # validate_env ran where Snakemake runs and left device checks to the extract jobs.
    validate_log = (workdir / "results" / "logs" / "validate_env" / f"{fp}.log").read_text()
    assert "deferred to the job that runs extraction" in validate_log


def test_every_shard_extracted_and_verified(runs):
    fp_dir = hidden_dir(runs["workdir"])
    summary = pd.read_csv(fp_dir / "verify_summary.tsv", sep="\t")
    assert sorted(summary["shard_id"]) == runs["shards"]
    assert summary["ok"].all(), summary.to_string()


def test_failed_job_fails_the_run_naming_its_log_after_retries_with_more_time(runs):
    p, bad = runs["failed"], runs["bad"]
    fp = hidden_dir(runs["workdir"]).name
    assert f"results/logs/extract/{fp}/{bad}.log" in p.out, fail_msg(p)
    attempts = [j for j, log in p.submitted if f"/rule_extract_shard/{fp}_{bad}/" in log]
    assert len(attempts) == 3, p.submitted  # profile: retries: 2
    records = sacct(attempts)
    assert all(records[j]["state"] == "FAILED" for j in attempts), records
    limits = [records[j]["timelimit"] for j in attempts]

    def minutes(limit):
        h, m, s = (int(x) for x in limit.split("-")[-1].split(":"))
        return 60 * h + m + s / 60

    assert minutes(limits[0]) < minutes(limits[1]) < minutes(limits[2]), limits
    # The failed job's SLURM log is named in the message too.
    assert any(log in p.out for j, log in p.submitted if j == attempts[-1])
    # The other shards went on (keep-going) and were extracted and verified (in their jobs).
    assert len(re.findall(r"\(Rule: extract_shard\)", p.out)) == N_SHARDS - 1, p.out[-3000:]


def test_rerun_after_the_fix_runs_only_what_failed(runs):
    p, bad = runs["fixed"], runs["bad"]
    assert job_stats(p.out) == {"extract_shard": 1, "verify_summary": 1, "extract": 1}, p.out[
        -3000:
    ]
    assert p.submitted and all(bad in log for _, log in p.submitted), p.submitted


def test_rerun_submits_nothing(runs):
    p = runs["again"]
    assert "Nothing to be done" in p.out, p.out[-3000:]
    assert not p.submitted


def test_train_draft_runs_as_one_job_with_a_task_per_rank(runs, profile_home):
    """`draft: {processes_per_node: 2}` on the CPU: train_draft is one SLURM job of 2 tasks
    (`--ntasks-per-node=2`, one CPU each, no GPU), its script starts the ranks as the tasks of
    one srun step (eagleflow.plan.launch), and they train with FSDP on gloo."""
    workdir = runs["workdir"]
    fp = hidden_dir(workdir).name
    config = merged(
        CONFIG,
        {
            "draft": {
                "processes_per_node": 2,
                "num_workers": 0,  # one CPU per rank: the node has 2
                "vocab_size": 256,
                "max_steps": 4,
                "batch_packs": 2,
                "max_tokens": 256,
                "save_every": 2,
                "eval_every": 2,
            }
        },
    )
    p = snakemake_slurm(
        workdir, profile_home, f"results/draft/{fp}/train/summary.json", config=config
    )
    assert p.returncode == 0, fail_msg(p)
    (job,) = [j for j, log in p.submitted if "/rule_train_draft/" in log]
    (record,) = sacct([job]).values()
    assert record["state"] == "COMPLETED" and "gres/gpu" not in record["tres"], record
    assert "cpu=2" in record["tres"] and "node=1" in record["tres"], record
    steps = subprocess.run(
        ["sacct", "-n", "-P", "-j", str(job), "-o", "JobID,NTasks,State"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    # the batch step runs Snakemake and the script; step 0 is the ranks' srun
    assert f"{job}.0|2|COMPLETED" in steps, steps
    summary = json.loads((workdir / f"results/draft/{fp}/train/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["parallelism"] == "fsdp (gloo)", summary
    assert summary["samples_cut"] == 0 and summary["end_step"] == 4
    log = (workdir / "results" / "logs" / "train_draft" / f"{fp}.log").read_text()
    assert "2 rank(s): srun --kill-on-bad-exit=1 --nodes=1 --ntasks=2" in log


def test_grouped_extract_jobs_share_one_allocation_and_one_model_load(runs, profile_home):
    """extract.shards_per_allocation: 2 with `--group-components extract=2 --cores <CPUs of one
    extract job>` (docs/engine-reuse.md#on-slurm): both shards' extract jobs run in one
    allocation, and the engine server the first starts serves the second."""
    workdir = runs["workdir"]
    fp_dir = hidden_dir(workdir)
    for shard in runs["shards"]:  # extracted again, same fingerprint and plan
        for suffix in (".safetensors", ".json", ".verify.json"):
            (fp_dir / f"{shard}{suffix}").unlink()
    grouped = merged(CONFIG, {"extract": {"shards_per_allocation": 2}})
    cpus = str(CONFIG["extract"]["cpus_per_job"])
    p = snakemake_slurm(
        workdir,
        profile_home,
        "extract",
        "--group-components",
        "extract=2",
        "--cores",
        cpus,
        config=grouped,
    )
    assert p.returncode == 0, fail_msg(p)
    assert len(p.submitted) == 1, p.submitted  # one allocation for both extract jobs
    (job,) = sacct([j for j, _ in p.submitted]).values()
    assert job["state"] == "COMPLETED" and "gres/gpu=4" in job["tres"], job
    records = [json.loads((fp_dir / f"{s}.json").read_text()) for s in runs["shards"]]
    assert all(r["engine"]["server"] for r in records)
    assert sorted(r["engine"]["loaded_here"] for r in records) == [False, True], records
    assert len({r["engine"]["server_pid"] for r in records}) == 1, records
    summary = pd.read_csv(fp_dir / "verify_summary.tsv", sep="\t")
    assert sorted(summary["shard_id"]) == runs["shards"] and summary["ok"].all()
