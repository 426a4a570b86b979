"""What TLS costs the engine server's wire (`draft.stream_tls`, docs/streaming.md#transport).

One process, two threads on loopback: a server thread answers each request with one pack's
states (a frame of `--mb` MiB, as `eagleflow.extract.stream.to_wire` sends it), a client
thread asks `--packs` times and times the answers. The same exchange runs over the unix
socket, plain TCP on 127.0.0.1 and TLS 1.3 on 127.0.0.1 (the run's self-signed certificate,
pinned; `eagleflow.serve.tls`), `--repeats` times each, interleaved; the best and median
rate of each transport are printed, in MB/s of states received (1 MB = 10^6 bytes).

The last line is `unix=<MB/s> tcp=<MB/s> tls=<MB/s> tls_over_tcp=<ratio>` (medians).
Usage: .venv/bin/python benchmarks/wire_tls.py [--mb 64] [--packs 16] [--repeats 5]
Record: docs/measurements/wire-tls.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from eagleflow.serve import wire
from eagleflow.serve.tls import client_context, make_certificate, server_context


def exchange(family, address, tls_dir: Path | None, payload: bytes, packs: int) -> float:
    """Seconds the client takes to receive `packs` answers of `payload`."""
    key = os.urandom(32)
    listener = wire.listen(address, family, 8)
    bound = listener.getsockname()
    server_tls = client_tls = None
    if tls_dir is not None:
        server_tls = server_context(tls_dir / "cert.pem", tls_dir / "key.pem")
        client_tls = client_context(tls_dir / "cert.pem")

    def serve():
        conn = wire.accept(listener, key, 10, server_tls)
        while conn.recv(60)[0] != "bye":
            conn.send(["done", {"states": {"dtype": "bfloat16", "bytes": payload}}])
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    conn = wire.connect(bound, family, key, 10, client_tls)
    t0 = time.perf_counter()
    for _ in range(packs):
        conn.send(["states", {}])
        answer = conn.recv(60)
        assert len(answer[1]["states"]["bytes"]) == len(payload)
    seconds = time.perf_counter() - t0
    conn.send(["bye"])
    thread.join(timeout=60)
    conn.close()
    listener.close()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=64, help="MiB of states per pack")
    p.add_argument("--packs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    payload = os.urandom(a.mb << 20)
    rates: dict[str, list[float]] = {"unix": [], "tcp": [], "tls": []}
    with tempfile.TemporaryDirectory() as d:
        tls_dir = Path(d)
        make_certificate(tls_dir / "cert.pem", tls_dir / "key.pem", "wire-tls benchmark")
        for r in range(a.repeats):
            for name in rates:
                if name == "unix":
                    args = (socket.AF_UNIX, f"\0eagleflow-bench-{os.getpid()}-{r}", None)
                else:
                    args = (socket.AF_INET, ("127.0.0.1", 0), tls_dir if name == "tls" else None)
                seconds = exchange(*args, payload, a.packs)
                rates[name].append(a.packs * len(payload) / seconds / 1e6)
    for name, xs in rates.items():
        print(f"{name}: best {max(xs):.0f} MB/s, median {statistics.median(xs):.0f} MB/s")
    med = {name: statistics.median(xs) for name, xs in rates.items()}
    print(
        f"unix={med['unix']:.0f} tcp={med['tcp']:.0f} tls={med['tls']:.0f} "
        f"tls_over_tcp={med['tls'] / med['tcp']:.3f}"
    )


if __name__ == "__main__":
    main()
