"""Run the real workflow (real Snakemake, real vLLM) in a scratch directory."""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")

# Small enough for CI (4 shards of 100 conversations), large enough to exercise caching.
SMALL = {"data": {"bundled_conversations": 400, "shard_size": 100}}

# Under every test config: the extraction tests run on the untrained embedded target and the
# dataset as it is (no target training, no response regeneration: minutes of CPU each);
# tests of those stages switch them back on explicitly.
EXTRACTION_BASE = {
    "target": {"path": "resources/targets/tiny-deepseek-v3"},
    "data": {"regenerate": {"enabled": False}},
}


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
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed "
            f"({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def hidden_dir(workdir: Path) -> Path:
    """The single fingerprint directory of a run (fails if there are several)."""
    (fp_dir,) = [p for p in (Path(workdir) / "results" / "hidden").iterdir() if p.is_dir()]
    return fp_dir


def copy_workdir(src: Path, dst: Path) -> Path:
    """A copy of a finished run, mtimes and Snakemake's metadata included."""
    import shutil

    shutil.copytree(src, dst, symlinks=True)
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
