"""Run the real workflow (real Snakemake, real vLLM) in a scratch directory."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")

# Small enough for CI (4 shards of 100 conversations), large enough to exercise caching.
SMALL = ["data.bundled_conversations=400", "data.shard_size=100"]


def snakemake(workdir: Path, *args, config=(), check=True, timeout=1800, env=None):
    cmd = [SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(REPO / "config" / "config.yaml"), "--cores", "2", *args]
    if config:
        cmd += ["--config", *config]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")
    return proc
