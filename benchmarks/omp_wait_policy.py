"""What OpenMP threads that wait by spinning cost when processes outnumber the cores, as in the
test suite (three pytest workers on two cores, each running engines, Snakemake jobs and ranks
of two threads), against threads that sleep (`OMP_WAIT_POLICY=PASSIVE`, tests/conftest.py).

The workload is the shape of the embedded targets' work: many small ops (a [64, 256] x
[256, 256] matmul, a relu and a row sum), each ending at an OpenMP barrier, in processes of
`--threads` threads. Arms, alternated `--repeats` times:

  spin     OMP_WAIT_POLICY unset (libgomp spins before it sleeps)
  passive  OMP_WAIT_POLICY=PASSIVE

each with 1 process (the cores to itself) and with `--processes` at once. Per arm: the wall
time of the slowest process's loop and the CPU seconds the loops used (torch's import left
out), medians over the repeats.

Usage (from the repository root):
  .venv/bin/python benchmarks/omp_wait_policy.py [--processes 3] [--threads 2] \
      [--iterations 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

WORKER = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
x, w = torch.randn(64, 256), torch.randn(256, 256)
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(int(sys.argv[1])):
    (x @ w).relu_().sum(dim=1)
print(time.perf_counter() - wall, time.process_time() - cpu)
"""


def run_group(policy: str | None, processes: int, threads: int, iterations: int):
    """(wall seconds of the slowest worker's loop, CPU seconds the loops used) of `processes`
    workers started together (torch's import is left out of both)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, "-c", WORKER, str(iterations), str(threads)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(processes)
    ]
    outs = [p.communicate()[0].split() for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a worker failed: {[p.returncode for p in procs]}")
    return max(float(o[0]) for o in outs), sum(float(o[1]) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    arms = [
        (name, policy, n)
        for n in (1, a.processes)
        for name, policy in (("spin", None), ("passive", "PASSIVE"))
    ]
    results = {arm[::2]: [] for arm in arms}
    for _ in range(a.repeats):
        for name, policy, n in arms:
            results[(name, n)].append(run_group(policy, n, a.threads, a.iterations))
    print(
        f"{os.cpu_count()} CPUs; {a.threads} threads per process, {a.iterations} iterations, "
        f"medians of {a.repeats}"
    )
    print(f"{'arm':<8} {'processes':>9} {'wall s':>8} {'CPU s':>8}")
    median = {}
    for (name, n), runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        median[(name, n)] = wall
        print(f"{name:<8} {n:>9} {wall:>8.2f} {cpu:>8.2f}")
    for n in (1, a.processes):
        ratio = median[("spin", n)] / median[("passive", n)]
        print(f"{n} process(es): spin takes {ratio:.1f}x the wall time of passive")


if __name__ == "__main__":
    main()
