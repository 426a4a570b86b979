"""The trainer's ranks: the process group, FSDP2 over a plain draft, and the sums that cross
the ranks.

Under torchrun (or srun, `eagleflow.train.rank`) every rank joins one process group, nccl on
CUDA and gloo on CPU; a single process trains the plain module. `parallelize` applies FSDP2
(`fully_shard`) to the draft from outside, as torchtitan's `parallelize` functions and
speculators' `distributed.py` do: each decoder layer, then the rest (fc, norm, lm_head) at the
root. Frozen tensors (the target's embedding) are left out: replicated, in no optimizer state
and no checkpoint.

Precision. On CUDA the shards (the master weights, and so the optimizer's state) are fp32;
FSDP's `MixedPrecisionPolicy` casts the gathered parameters to bf16 for the forward and
backward, and reduce-scatters the gradients in fp32 (`mixed_precision`). On CPU (gloo) the
draft trains in fp32 throughout. A single process on CUDA has no FSDP to cast for it and runs
the forward under bf16 autocast (`Parallelism.autocast`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallelism:
    """Where this rank trains and how the draft is split; `describe` goes to the summary."""

    rank: int
    world: int
    device: torch.device
    fsdp: bool = False
    mixed_precision: bool = False  # FSDP casts parameters to bf16 (CUDA)

    @property
    def autocast(self) -> bool:
        """bf16 autocast around the forward: on CUDA where FSDP does not cast (one process)."""
        return self.device.type == "cuda" and not self.mixed_precision

    def describe(self) -> str:
        if not self.fsdp:
            return "single process"
        policy = ", bf16 parameters, fp32 reduction" if self.mixed_precision else ""
        return f"fsdp ({dist.get_backend()}{policy})"


def init_distributed(device_setting: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world size, device): a process group under torchrun (nccl on CUDA, gloo on
    CPU), none in a single process. `device_setting`: `draft.device` (auto: cuda:LOCAL_RANK
    where CUDA is, else cpu)."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_setting != "auto":
        device = torch.device(device_setting)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not torchrun:
        return 0, 1, device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def mixed_precision(device: torch.device):
    """FSDP's policy on `device`: on CUDA bf16 parameters (gathered) and gradients (computed),
    reduced in fp32, over fp32 shards; None on CPU (fp32 throughout)."""
    if device.type != "cuda":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallelize(model, device: torch.device) -> Parallelism:
    """FSDP2 over the draft's trainable modules when a process group is up (module doc)."""
    if not dist.is_initialized():
        return Parallelism(0, 1, device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    frozen = {p for p in model.parameters() if not p.requires_grad} or None
    policy = mixed_precision(device)
    options = {"mesh": mesh, "ignored_params": frozen}
    if policy is not None:
        options["mp_policy"] = policy
    for layer in model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    world = dist.get_world_size()
    return Parallelism(dist.get_rank(), world, device, True, policy is not None)


def all_reduce(values: torch.Tensor) -> torch.Tensor:
    """Sums over the ranks (one collective), as float64 on the host; the values themselves in
    a single process. The trainer's one read-back of its figures per step."""
    flat = values.to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(flat)
    return flat.cpu()


def all_reduce_sums(values: list[float], device) -> list[float]:
    """Sums of host numbers over the ranks (one collective)."""
    if not dist.is_initialized():
        return list(values)
    return all_reduce(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
