"""Run the trainer's multi-rank tests again and again, optionally beside a real extraction,
and count how many runs in a row pass (issue 41: a rank hung at its first validation now and
then, on a loaded 2-core machine).

Each round runs `pytest -k SELECTION tests/test_train_distributed.py` once (every torchrun test
by default: 2 ranks against 1, sequence splitting, Muon, resume across world sizes and the
SIGKILL of one rank); a round that fails or passes its `--round-timeout` stops the soak. With
`--beside-extract`, `snakemake --cores all extract` of the embedded default runs in a scratch
directory beside the rounds, started again (from scratch) whenever it finishes, so that the
cores stay loaded the whole time.

Prints one line per round (its seconds, passed or not) and at the end
`rounds_passed=N of M, median_round_s=..., max_round_s=..., extract_runs=...`.

Usage (from the repository root):
  .venv/bin/python benchmarks/trainer_soak.py --rounds 30 --beside-extract
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TORCHRUN_TESTS = (
    "two_ranks or split_over_two_ranks or frozen_target_lm_head or muon_orthogonalizes "
    "or across_world_sizes or sigkill"
)


class Extraction:
    """`snakemake --cores all extract` of the embedded default, restarted from scratch when it
    ends, in a session of its own (stopped with its engine and jobs)."""

    def __init__(self, root: Path):
        self.root, self.proc, self.runs = root, None, 0

    def keep_running(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        if self.proc is not None:
            self.runs += 1
            print(f"extract beside the rounds: run {self.runs} ended ({self.proc.returncode})")
        work = self.root / "extract"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        cmd = [str(BIN / "snakemake"), "--snakefile", str(REPO / "Snakefile")]
        cmd += ["--directory", str(work), "--configfile", str(REPO / "config" / "config.yaml")]
        cmd += ["--cores", "all", "extract"]
        log = open(self.root / f"extract-{self.runs}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("-k", default=TORCHRUN_TESTS, help="pytest -k selection")
    p.add_argument("--round-timeout", type=float, default=900)
    p.add_argument("--beside-extract", action="store_true")
    a = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="eagleflow-soak-"))
    extraction = Extraction(scratch) if a.beside_extract else None
    times, passed = [], 0
    try:
        for r in range(1, a.rounds + 1):
            if extraction is not None:
                extraction.keep_running()
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-n", "0"]
            cmd += ["tests/test_train_distributed.py", "-k", a.k]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(
                    cmd, cwd=REPO, capture_output=True, text=True, timeout=a.round_timeout
                )
                ok, tail = proc.returncode == 0, proc.stdout.strip().splitlines()[-1:]
            except subprocess.TimeoutExpired:
                ok, tail = False, [f"timed out after {a.round_timeout:.0f} s"]
            took = time.perf_counter() - t0
            times.append(took)
            print(f"round {r}: {took:.0f} s, {'passed' if ok else 'FAILED'}: {tail}", flush=True)
            if not ok:
                break
            passed += 1
    finally:
        if extraction is not None:
            extraction.stop()
    extract_runs = extraction.runs if extraction is not None else 0
    print(
        f"rounds_passed={passed} of {a.rounds}, median_round_s={statistics.median(times):.0f}, "
        f"max_round_s={max(times):.0f}, extract_runs_finished={extract_runs}"
    )
    return 0 if passed == a.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
