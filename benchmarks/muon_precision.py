"""What Muon's Newton-Schulz iterations cost in bf16 (torch.optim.Muon's choice) against float32
(eagleflow.train.optimizer.Muon's choice on a CPU), side by side on this machine, and how far
the two updates lie apart.

Per matrix shape (the embedded default's draft matrices: hidden 256, its fc 256 x 768, and a
larger square one): the median time of one orthogonalization (5 iterations) in each dtype,
their ratio, and the largest difference between the two results relative to the largest
entry. On a CPU without native bf16 matrix units (AVX2 only) bf16 products take a slow path.

Usage (from the repository root):
  .venv/bin/python benchmarks/muon_precision.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from eagleflow.train.optimizer import orthogonalize  # noqa: E402

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's and Keller Jordan's quintic
SHAPES = [(256, 256), (256, 768), (1024, 1024)]


def timed(grad: torch.Tensor, dtype: torch.dtype, repeats: int) -> tuple[float, torch.Tensor]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = orthogonalize(grad, COEFFICIENTS, 5, 1e-7, dtype)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.repeats}")
    print(f"{'shape':>12} {'bf16 ms':>10} {'fp32 ms':>10} {'ratio':>7} {'max rel diff':>13}")
    for rows, cols in SHAPES:
        grad = torch.randn(rows, cols)
        bf16_s, bf16 = timed(grad, torch.bfloat16, a.repeats)
        fp32_s, fp32 = timed(grad, torch.float32, a.repeats)
        diff = float((bf16.float() - fp32).abs().max() / fp32.abs().max())
        print(
            f"{rows:>5} x {cols:<5} {bf16_s * 1e3:>10.2f} {fp32_s * 1e3:>10.2f} "
            f"{bf16_s / fp32_s:>7.1f} {diff:>13.2e}"
        )


if __name__ == "__main__":
    main()
