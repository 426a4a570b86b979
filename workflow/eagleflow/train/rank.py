"""One srun task: a rank of the trainer (`python -m eagleflow.train.rank ARGS`, the command
that `eagleflow.plan.launch.command` builds on SLURM)."""

from __future__ import annotations

import os

from eagleflow.plan.launch import LAUNCHER, LaunchError


def rank_env(environ) -> dict[str, str]:
    """torch.distributed's variables of one srun task, from SLURM's."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR") if k not in environ]
    if missing:
        raise LaunchError(
            f"{', '.join(missing)} not set: python -m {LAUNCHER} runs as a task of the srun "
            "step that eagleflow.plan.launch.command builds"
        )
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
    }


def main(argv=None) -> None:
    """One srun task: a rank of the trainer."""
    os.environ.update(rank_env(os.environ))
    from eagleflow.train import cli

    cli.main(argv)


if __name__ == "__main__":
    main()
