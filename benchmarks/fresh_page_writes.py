"""What writing new file data costs this machine's CPU, back to back and after a pause.

Writes `--mib` MiB into a new (sparse) file in chunks of 32 MiB, as the capture worker writes a
shard's rows, and prints the CPU seconds of the writes (`pwrite`, which fills the page cache) and
of the `fdatasync`, three times with no pause and three times `--pause` seconds apart. Where a
virtual machine hands freed memory back to its host (free page reporting), a page the kernel
allocates after the pause faults on the host again, and the same writes cost many times the
CPU: extraction pays that for every byte of states, plain prefill writes nothing. Last, the
same writes with O_DIRECT (no page cache; from a page-aligned buffer) after the same pauses.

Usage: .venv/bin/python benchmarks/fresh_page_writes.py [--dir /tmp] [--mib 256] [--pause 10]
"""

import argparse
import mmap
import os
import time
from pathlib import Path

import numpy as np

CHUNK = 32 << 20


def write_once(path: Path, data, chunks: int, direct: bool = False) -> tuple[float, float]:
    """CPU seconds of the pwrites and of the fdatasync of one new file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        os.ftruncate(fd, chunks * CHUNK)
        c0 = time.thread_time()
        for i in range(chunks):
            os.pwrite(fd, data, i * CHUNK)
        c1 = time.thread_time()
        os.fdatasync(fd)
        return c1 - c0, time.thread_time() - c1
    finally:
        os.close(fd)
        path.unlink()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--pause", type=float, default=10.0)
    args = ap.parse_args()
    chunks = max(1, (args.mib << 20) // CHUNK)
    data = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)
    path = args.dir / f"fresh-page-writes-{os.getpid()}.bin"
    aligned = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    aligned.write(data.tobytes())
    arms = (
        ("back to back", 0.0, False),
        (f"{args.pause:g} s apart", args.pause, False),
        (f"O_DIRECT, {args.pause:g} s apart", args.pause, True),
    )
    results = []  # per arm, (pwrite CPU s, fdatasync CPU s) of each run
    for label, pause, direct in arms:
        runs = []
        for _ in range(3):
            time.sleep(pause)
            runs.append(write_once(path, aligned if direct else data, chunks, direct))
        results.append(runs)
        print(
            f"{label}: pwrite CPU s {[round(w, 3) for w, _ in runs]}, "
            f"fdatasync CPU s {[round(s, 3) for _, s in runs]} ({chunks * 32} MiB each)"
        )
    fast, slow = (sorted(w for w, _ in runs)[1] for runs in results[:2])  # medians
    print(f"ratio={slow / fast:.1f}")


if __name__ == "__main__":
    main()
