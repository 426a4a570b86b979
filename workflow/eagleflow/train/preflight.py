"""The launch of a train_draft job where it runs: the GPUs it sees, and the check before any
rank starts (`eagleflow.plan.launch` plans the launch torch-free; this half loads torch and the
trainer's memory check)."""

from __future__ import annotations

from eagleflow.plan.launch import Launch, LaunchError, trainer_devices
from eagleflow.plan.resources import TrainJob, processes_per_node
from eagleflow.plan.settings import DraftSettings, TrainConfig


def launch_for_job(draft: DraftSettings, extract: dict, srun: bool, threads: int) -> Launch:
    """The launch of a train_draft job: under SLURM (`srun`: its resources hold `mpi`),
    the ranks and CPUs it was submitted with (`TrainJob`); on this machine, every GPU
    it sees when `draft.processes_per_node` is null, and its `threads` shared by them."""
    job = TrainJob.from_settings(draft, extract)
    if srun:
        return Launch(job.nodes, job.processes_per_node, job.device, True, job.cpus_per_rank)
    visible, devices = None, None
    if job.device == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if not visible:
            raise LaunchError(
                "train_draft would train on CUDA (draft.device, where auto follows "
                "extract.device) but this machine has no GPU: set draft.device to cpu"
            )
        devices = trainer_devices(draft.states, visible)
        if devices is not None:
            visible = len(devices.split(","))
    per_node = processes_per_node(draft.ranks, extract, visible)
    return Launch(job.nodes, per_node, job.device, False, max(1, threads // per_node), devices)


def preflight(source, target, vocab, cfg: TrainConfig, overrides: dict, launch: Launch, log):
    """Before any rank starts: `Launch.check`, then the trainer's own memory check
    (`eagleflow.train.memory_plan.check_memory`) of the draft at the target's shape and the
    longest pack, at this launch's world size, on this node's first device (left to the
    ranks where the launcher sees no GPU). `source`: the run's `StateSource`
    (`eagleflow.train.states.state_source`), whose samples are read as the trainer reads
    them (`TrainData.read`: offsets only, no states). `cfg`: `DraftSettings.train`;
    `overrides`: the DraftConfig overrides (`DraftSettings.model.overrides()`)."""
    launch.check(cfg.batch_packs, cfg.sequence_parallel, source.served)
    import torch

    if launch.device == "cuda" and not torch.cuda.is_available() and not cfg.device_memory_gb:
        log("no GPU visible where the ranks are launched: each rank checks its memory plan")
        return None

    from eagleflow.draft.model import draft_config_for
    from eagleflow.target.head import read_target_config
    from eagleflow.train.data import TrainData
    from eagleflow.train.memory_plan import check_memory

    config = read_target_config(target)
    data = TrainData.read(source, int(config["num_hidden_layers"]), cfg, log)
    draft_cfg = draft_config_for(config, vocab.size, len(data.layout.aux_ids), **overrides)
    device = torch.device("cuda", 0) if launch.device == "cuda" else torch.device("cpu")
    pack_tokens = max(cfg.max_tokens, data.table.longest_train)
    return check_memory(draft_cfg, cfg, pack_tokens, launch.world_size, device, log)
