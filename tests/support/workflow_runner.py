"""Run the real workflow (real Snakemake, real vLLM) in a scratch directory: to its end, or
until a test kills it."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")

# Small enough for CI (4 shards of 100 conversations), large enough to exercise caching.
SMALL = {"data": {"bundled_conversations": 400, "shard_size": 100}}

# Under every test config: the extraction tests run on the untrained embedded target and the
# dataset as it is (no target training, no response regeneration: minutes of CPU each);
# tests of those stages switch them back on explicitly. The suite runs three workers on two
# cores, where the next job of a run can take longer than a minute to start: an engine server
# then waits for it (it still stops when its Snakemake run ends) instead of idling out and
# costing a second load.
EXTRACTION_BASE = {
    "target": {"path": "resources/targets/tiny-deepseek-v3"},
    "data": {"regenerate": {"enabled": False}},
    "extract": {"engine_idle_seconds": 600},
}


# The environment of the runs a test starts (Snakemake, its jobs, their vLLM engines): OpenMP
# threads that wait sleep instead of spinning, since the suite runs more processes than cores
# (docs/testing.md; benchmarks/omp_wait_policy.py). Only for these fresh processes: a pytest
# worker keeps libgomp's default, as a loader worker forked from it deadlocked under PASSIVE.
CHILD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


# data.regenerate for the tests that regenerate: switched on, short replies (the untrained
# target loops until max_new_tokens), the CPU's fast plain-attention path, and a whole chunk
# (at most 64 rows) decoded together; each test sets its own shard and chunk sizes.
SHORT_REGENERATION = {"enabled": True, "mla": False, "max_num_seqs": 64, "max_new_tokens": 8}


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def write_config(workdir: Path, override: dict) -> Path:
    """The default config with `override` merged in, written into the run's directory."""
    base = merged(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), EXTRACTION_BASE)
    path = Path(workdir) / "test-config.yaml"
    path.write_text(yaml.safe_dump(merged(base, override)))
    return path


def snakemake_command(workdir: Path, *args, config=None) -> list[str]:
    """The command line of a Snakemake run of this workflow in `workdir` with `config`."""
    configfile = write_config(workdir, config or {})
    return [
        SNAKEMAKE,
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(configfile),
        "--cores",
        "2",
        *args,
    ]


def snakemake(workdir: Path, *args, config=None, check=True, timeout=1800, env=None):
    cmd = snakemake_command(workdir, *args, config=config)
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **CHILD_ENV, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed "
            f"({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def run_and_kill(
    workdir: Path,
    targets: list[str],
    config: dict,
    when: Callable[[], bool],
    *,
    kill: Callable[[subprocess.Popen], None] | None = None,
    poll_s: float = 0.1,
    timeout: float = 300,
    log: str | None = "killed-run.out",
    unlock: bool = True,
) -> subprocess.Popen:
    """Start Snakemake for `targets` in a session of its own, check `when()` every `poll_s`
    seconds, and once it holds `kill(proc)`; by default (and for whatever `kill` leaves running)
    SIGKILL the whole process group: Snakemake, its jobs, vLLM's engine and workers, as on a
    crashed node. Fails if the run ends first, or `timeout` seconds pass.

    The run's output goes to `workdir / log` (None: nowhere) and its tail into that failure.
    `unlock`: run `--unlock` after, as a user does, since a killed Snakemake leaves its lock.
    Returns the ended process."""
    cmd = snakemake_command(workdir, *targets, config=config)
    out = open(Path(workdir) / log, "w") if log else subprocess.DEVNULL
    env = {**os.environ, **CHILD_ENV}
    proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True, env=env)
    deadline = time.time() + timeout
    try:
        while not when():
            if proc.poll() is not None:
                tail = (Path(workdir) / log).read_text()[-3000:] if log else ""
                raise AssertionError(f"the run ended before the kill point:\n{tail}")
            assert time.time() < deadline, "kill point never reached"
            time.sleep(poll_s)
        if kill is not None:
            kill(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        if log:
            out.close()
    if unlock:
        snakemake(workdir, "--unlock", config=config)
    return proc


def hidden_dir(workdir: Path) -> Path:
    """The single fingerprint directory of a run (fails if there are several)."""
    (fp_dir,) = [p for p in (Path(workdir) / "results" / "hidden").iterdir() if p.is_dir()]
    return fp_dir


def copy_workdir(src: Path, dst: Path) -> Path:
    """A copy of a finished run, mtimes and Snakemake's metadata included (`dst` new or empty)."""
    import shutil

    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    return dst


def started_jobs(output: str) -> dict:
    """{rule: count} of the jobs a real run started (its 'rule X:', 'localrule X:',
    'checkpoint X:' and 'localcheckpoint X:' lines).

    A run that passes a checkpoint prints its job table before the checkpoint only, so the
    jobs added after it are counted from what was started."""
    counts = {}
    for line in output.splitlines():
        m = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):$", line.strip())
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def job_counts(output: str) -> dict:
    """{rule: count} from the 'Job stats' table of a Snakemake run or dry run."""
    counts, in_table = {}, False
    for line in output.splitlines():
        if line.startswith("Job stats:"):
            in_table, counts = True, {}
            continue
        if in_table:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                if parts[0] != "total":
                    counts[parts[0]] = int(parts[1])
            elif counts and not line.strip():
                in_table = False
    return counts
