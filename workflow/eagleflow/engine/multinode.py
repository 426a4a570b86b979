"""Engines that span several nodes, through vLLM's own multi-node launch.

vLLM 0.32's multiprocessing executor runs one engine over several nodes
(`ParallelConfig.nnodes`, `node_rank`, `master_addr`, `master_port`; `MultiprocExecutor` with
`nnodes_within_dp > 1`): node rank 0 builds the `LLM` and the engine core; every other node
runs `vllm serve <target> --headless --nnodes N --node-rank r ...` with the same engine
arguments (through `eagleflow.engine.headless_node`, vLLM's serve command without its CLI
wrapper), whose `run_headless` starts that node's workers; they join the torch.distributed
group at `master_addr:master_port` and take their work from node 0's message queues, so
`collective_rpc` (eagleflow's capture hooks) reaches every worker on every node.

eagleflow uses this launch, not vLLM's Ray executor: it is part of vLLM (Ray is an extra
package, absent from the environments eagleflow builds), it needs no cluster to be started and
stopped besides the engine itself, and it runs on one machine with two "nodes" on loopback,
which is how it is tested (tests/test_multinode.py). Inside a SLURM allocation the other nodes
are reached with `srun --overlap --nodes=1 --ntasks=1 --nodelist=HOST`; their output goes to
the job's stdout and stderr, which is the shard's log. A node whose process ends while the
engine runs interrupts the job (SIGINT; if the job is still alive a minute later, for instance
blocked waiting for the engine to start, it exits with status 1), with the node's traceback
above in the log; when the engine stops, the other nodes' processes are stopped (SIGTERM, then
SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field

# Test hook: run the other "nodes" as local processes on 127.0.0.1 (one machine, loopback).
LOOPBACK_ENV = "EAGLEFLOW_LOOPBACK_NODES"
# After a node fails: how long the job has to stop on SIGINT before it is ended.
GRACE_SECONDS = 60


class MultiNodeError(RuntimeError):
    pass


def headless_args(llm_kwargs: dict) -> list[str]:
    """`vllm serve` arguments that give a headless node the engine arguments of `LLM(**kw)`:
    `key_name=value` -> `--key-name value`, True -> `--key-name`, False -> `--no-key-name`,
    dicts as JSON. The model is the positional argument."""
    args = [str(llm_kwargs["model"])]
    for key, value in llm_kwargs.items():
        if key == "model" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_hosts() -> list[str]:
    """The hosts of this SLURM allocation, the job's own (first) node first."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


@dataclass
class NodeGroup:
    """The nodes one engine spans: `hosts[0]` is this node (node rank 0, the `LLM`)."""

    hosts: list[str]
    launcher: str  # "srun" (inside a SLURM allocation) or "local" (loopback test)
    master_port: int = field(default_factory=free_port)
    procs: list = field(default_factory=list)
    stopping: bool = False

    @classmethod
    def for_engine(cls, nodes: int) -> NodeGroup:
        if os.environ.get(LOOPBACK_ENV) == "1":
            return cls(["127.0.0.1"] * nodes, "local")
        hosts = slurm_hosts()
        if len(hosts) < nodes:
            where = (
                f"its SLURM allocation has {len(hosts)} node(s)"
                if hosts
                else "it runs outside a SLURM allocation"
            )
            raise MultiNodeError(
                f"extract.nodes is {nodes} but {where}; run the extract job under the SLURM "
                f"profile (it asks for {nodes} nodes) or set extract.nodes: 1"
            )
        return cls(hosts[:nodes], "srun")

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    def head_kwargs(self) -> dict:
        """`LLM(...)` arguments of node rank 0."""
        return {
            "nnodes": len(self.hosts),
            "node_rank": 0,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "distributed_executor_backend": "mp",
        }

    def node_command(self, rank: int, llm_kwargs: dict) -> list[str]:
        """The command that runs node `rank`'s workers (headless vLLM), with its launcher."""
        kwargs = llm_kwargs | self.head_kwargs() | {"node_rank": rank, "headless": True}
        cmd = [sys.executable, "-m", "eagleflow.engine.headless_node", *headless_args(kwargs)]
        if self.launcher == "srun":
            host = self.hosts[rank]
            # --overlap: the job's own step (this process) already holds the allocation's CPUs.
            return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}", *cmd]
        return cmd

    def node_env(self, rank: int, world_size: int) -> dict:
        """Node `rank`'s environment: this one's. On loopback, the CPU cores bound for the
        engine's workers (VLLM_CPU_OMP_THREADS_BIND, one group per worker) are shared out so
        that each node's workers get their own (each node indexes it by local rank)."""
        env = dict(os.environ)
        bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
        groups = bind.split("|")
        local = world_size // len(self.hosts)
        if self.launcher == "local" and len(groups) == world_size:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(groups[rank * local : (rank + 1) * local])
        return env

    def start(self, llm_kwargs: dict, world_size: int) -> None:
        """Start every other node's workers (before node 0 builds its `LLM`, which waits for
        them), and a thread that watches them."""
        for rank in range(1, len(self.hosts)):
            cmd = self.node_command(rank, llm_kwargs)
            print(f"node rank {rank} ({self.hosts[rank]}): {' '.join(cmd)}", flush=True)
            env = self.node_env(rank, world_size)
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        threading.Thread(target=self._watch, name="eagleflow-node-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self.stopping:
                    print(
                        f"eagleflow: node rank {rank} ({self.hosts[rank]}) ended with exit code "
                        f"{code} while the engine was running; its traceback is above in this "
                        "log",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.stopping = True
                    os.kill(os.getpid(), signal.SIGINT)
                    # vLLM's engine start-up wait does not always give way to SIGINT.
                    threading.Event().wait(GRACE_SECONDS)
                    print("eagleflow: the job did not stop on SIGINT; exiting", flush=True)
                    os._exit(1)
            threading.Event().wait(1.0)

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
