"""How the workflow starts the draft trainer: `draft.nodes` x `draft.processes_per_node` ranks.

    one rank          python -m eagleflow.train.cli ARGS                (a plain process)
    one node, here    python -m torch.distributed.run --standalone --nnodes 1
                          --nproc_per_node P -m eagleflow.train.cli ARGS
    SLURM             srun --kill-on-bad-exit=1 --nodes=N --ntasks=N*P --ntasks-per-node=P
                          --cpus-per-task=C --mem=0 [--gres=gpu:P]
                          python -m eagleflow.train.rank ARGS

On SLURM every rank is a task of one `srun` step, without torchrun (the pattern of SLURM's MPI
launches and of Lightning's SLURM support; torchtitan's multi-node script runs `srun torchrun`
per node instead, which adds a second supervisor and a c10d rendezvous):
`eagleflow.train.rank.rank_env` turns the task's `SLURM_PROCID`, `SLURM_NTASKS` and
`SLURM_LOCALID` into torch's `RANK`, `WORLD_SIZE` and `LOCAL_RANK`, and the rendezvous is the
`MASTER_ADDR:MASTER_PORT` the launcher picked on the allocation's first node, where rank 0 runs
(block distribution). SLURM starts, watches and ends the ranks: `--kill-on-bad-exit` ends the
step when one rank fails, and srun names the task that did. Each task sees every GPU of its node
and takes `cuda:LOCAL_RANK`.

The job (train_draft's resources, `eagleflow.plan.resources`) is submitted with those tasks; the
job step that runs the script itself is the allocation's batch step (the `mpi` resource keeps
the jobstep plugin from wrapping it in an `srun` of its own), so the ranks' `srun` is the only
step. `preflight` (`eagleflow.train.preflight`) refuses, in one sentence naming the key, a run
that cannot start: more nodes than one outside SLURM, a global batch the ranks cannot share, a
draft that does not fit a device (`eagleflow.train.memory_plan`).
"""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from eagleflow.plan.settings import (
    ARCH_KEYS,
    EXTENT_KEYS,
    RECIPE_KEYS,
    DraftSettings,
    SettingsError,
    TrainConfig,
    check_world,
    llama_default,
)

TRAINER = "eagleflow.train.cli"
LAUNCHER = "eagleflow.train.rank"  # one srun task, one rank
CONFIG_FILE = "train_config.json"  # in the trainer's work directory


class LaunchError(ValueError):
    """A setting that cannot be launched; its message names the key."""


@dataclass(frozen=True)
class Launch:
    """Where and how many ranks train."""

    nodes: int
    processes_per_node: int
    device: str  # cuda or cpu
    srun: bool = False  # inside a SLURM allocation: one srun task per rank
    cpus_per_rank: int = 1  # srun's --cpus-per-task, and each rank's torch threads
    # CUDA_VISIBLE_DEVICES of the ranks on this node: the devices a streaming run's engine
    # server does not take (draft.stream_engine_devices); None: every device.
    devices: str | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    def check(self, batch_packs: int, sequence_parallel: int = 1, streamed=False) -> None:
        """One sentence naming the key, for a launch that cannot work (the rules tying the
        settings to the ranks: `eagleflow.plan.settings.check_world`)."""
        if self.nodes > 1 and not self.srun:
            raise LaunchError(
                f"draft.nodes is {self.nodes}, but train_draft runs on this machine (torchrun "
                "starts ranks on one node only): set draft.nodes to 1, or run the workflow "
                "with --profile slurm"
            )
        try:
            check_world(self.world_size, batch_packs, sequence_parallel, streamed)
        except SettingsError as e:
            raise LaunchError(str(e)) from None


def trainer_devices(draft: dict, visible: int) -> str | None:
    """The ranks' devices when a streaming run's engine server takes some of this node's
    (`draft.stream_engine_devices`): the others, as CUDA_VISIBLE_DEVICES; None otherwise."""
    engine = draft.get("stream_engine_devices")
    if draft.get("states", "stored") == "stored" or engine is None:
        return None
    try:
        taken = {int(d) for d in str(engine).split(",")}
    except ValueError:
        raise LaunchError(
            f'draft.stream_engine_devices = {engine!r}: CUDA device indices, e.g. "0,1,2,3"'
        ) from None
    rest = [d for d in range(visible) if d not in taken]
    if not rest or not taken <= set(range(visible)):
        raise LaunchError(
            f"draft.stream_engine_devices = {engine!r} on a node with {visible} GPUs leaves "
            "the trainer none (or names a device it lacks): give the engine fewer devices"
        )
    return ",".join(map(str, rest))


# ---------------------------------------------------------------- settings and command


def train_settings(draft: dict, heldout_modulus: int, device: str) -> tuple[TrainConfig, dict]:
    """(TrainConfig, DraftConfig overrides) of the workflow's `draft` section
    (`DraftSettings.from_config`). The trainer gets `cpu`, or `auto` on CUDA (each rank then
    takes cuda:LOCAL_RANK)."""
    config = {"draft": draft, "data": {"heldout_modulus": heldout_modulus}}
    settings = DraftSettings.from_config(config, device)
    return settings.train, settings.draft_overrides


def recipe_settings(draft: dict) -> dict:
    """The `draft` keys that decide the trained weights or the run's extent: train_draft's
    params, so that a change to one of them (and to nothing else) runs the job again (it then
    resumes or restarts, as its checkpoint's recipe decides: `settings.recipe_of`).
    `heldout_modulus` is `data.heldout_modulus`, a param of its own."""
    names = set(RECIPE_KEYS) | set(EXTENT_KEYS) | set(ARCH_KEYS)
    return {k: v for k, v in sorted(llama_default(draft).items()) if k in names}


def trainer_args(
    shards, target, vocab, out, cfg: TrainConfig, overrides: dict, stream=None
) -> list[str]:
    """The trainer's command-line arguments (`eagleflow.train.cli.main`); the settings go
    into `out`/train_config.json, which the log and a rerun by hand can read, and a
    `stream` source (`eagleflow.train.states.StreamSource`) into `out`/stream.json."""
    Path(out).mkdir(parents=True, exist_ok=True)
    config = Path(out) / CONFIG_FILE
    config.write_text(json.dumps(asdict(cfg), indent=1) + "\n")
    return [
        "--shards",
        *map(str, shards),
        "--target",
        str(target),
        "--vocab",
        str(vocab),
        "--out",
        str(out),
        "--config",
        str(config),
        "--draft",
        json.dumps(overrides),
    ] + (["--stream", stream_file(out, stream)] if stream is not None else [])


def stream_file(out, stream) -> str:
    path = Path(out) / "stream.json"
    stream.save(path)
    return str(path)


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str]  # set for the launcher (and so for every rank)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def command(launch: Launch, args: list[str], python: str = sys.executable, port=None) -> Command:
    """The command that starts every rank of `launch` with the trainer's `args`."""
    env = {"OMP_NUM_THREADS": str(launch.cpus_per_rank)}
    if launch.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = launch.devices
    if launch.device == "cpu":  # idle OpenMP threads sleep: spinning ones starve a shared CPU
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if launch.world_size == 1:
        return Command([python, "-m", TRAINER, *args], env)
    if not launch.srun:
        run = [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
        run += ["--nproc_per_node", str(launch.processes_per_node)]
        return Command([*run, "-m", TRAINER, *args], env)
    # Rank 0 runs on the allocation's first node, where this launcher runs.
    env["MASTER_ADDR"] = "127.0.0.1" if launch.nodes == 1 else socket.gethostname()
    env["MASTER_PORT"] = str(port or free_port())
    srun = [
        "srun",
        "--kill-on-bad-exit=1",
        f"--nodes={launch.nodes}",
        f"--ntasks={launch.world_size}",
        f"--ntasks-per-node={launch.processes_per_node}",
        f"--cpus-per-task={launch.cpus_per_rank}",
        "--mem=0",  # the step: all of the job's memory on each node
    ]
    if launch.device == "cuda":  # every task sees its node's GPUs, and takes cuda:LOCAL_RANK
        srun.append(f"--gres=gpu:{launch.processes_per_node}")
    return Command([*srun, python, "-m", LAUNCHER, *args], env)
