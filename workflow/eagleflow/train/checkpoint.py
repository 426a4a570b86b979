"""Checkpoints of a draft training run, on disk under the trainer's output directory:

    checkpoints/step-00000120/        the latest finished checkpoint (and the one before it,
                                      kept in case this one is lost): ONE
                                      `torch.distributed.checkpoint` save of every Stateful
                                      component (model, optimizer, progress, rng), each rank
                                      writing its own shards (`__<rank>_0.distcp`, `.metadata`)
        recipe.json                   what decides the weights (`training_recipe`): a rerun
                                      resumes only when its own recipe equals this one
    checkpoints/step-00000160.partial/  a save in progress: never read, removed on start
    best/                             the draft with the best simulated acceptance length,
                                      consolidated for export (`load_trained`)
        model.safetensors             trainable weights + d2t/t2d in fp32, no frozen tensor
        draft.json                    draft config, aux/layer ids, target, vocab, step, AL

A checkpoint is written into `<name>.partial` by every rank and renamed into place by rank 0
once all ranks have written (DCP's save ends with a collective that writes `.metadata`), and
the folder is fsynced after the rename, so a kill (or a crash of the machine) at any moment
leaves either the previous checkpoint or the new one, never a half-written one taken for
finished. Frozen tensors (the target's embedding, its norm and
lm_head) are in no checkpoint: they are read again from the target. DCP reshards on load,
so a checkpoint resumes at any world size (FSDP or a single process).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from eagleflow.store.locks import fsync_dir

CHECKPOINTS, BEST, RECIPE = "checkpoints", "best", "recipe.json"
BEST_WEIGHTS, BEST_META = "model.safetensors", "draft.json"
PARTIAL = ".partial"
KEEP = 2  # finished checkpoints kept: the latest and the one before it


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def step_dir(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step:08d}"


def finished(out) -> list[Path]:
    """Finished checkpoints, oldest first."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = [
        d
        for d in root.iterdir()
        if d.is_dir() and d.name.startswith("step-") and not d.name.endswith(PARTIAL)
    ]
    return sorted((d for d in done if (d / ".metadata").exists()), key=lambda d: d.name)


def latest(out) -> Path | None:
    done = finished(out)
    return done[-1] if done else None


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.split("-")[1])


def clean(out, rank: int) -> None:
    """Remove saves that never finished (a kill during a save)."""
    root = Path(out) / CHECKPOINTS
    if rank == 0 and root.is_dir():
        for d in root.iterdir():
            if d.name.endswith(PARTIAL):
                shutil.rmtree(d, ignore_errors=True)
    best, old = Path(out) / BEST, Path(out) / (BEST + ".old")
    if rank == 0 and old.exists():
        if best.exists():
            shutil.rmtree(old)
        else:  # killed between the two renames of `save_best`: the old best is still valid
            os.replace(old, best)
    _barrier()


def drop_best(out, rank: int) -> None:
    if rank == 0:
        shutil.rmtree(Path(out) / BEST, ignore_errors=True)
    _barrier()


def read_recipe(path: Path) -> dict:
    with open(Path(path) / RECIPE) as f:
        return json.load(f)


def changed_keys(old, new, prefix: str = "") -> list[str]:
    """Dotted names of the recipe entries that differ (nested dicts compared key by key)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += changed_keys(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def save(state: dict, out, step: int, recipe: dict, rank: int) -> Path:
    """Every rank writes its part of `state` into step-N.partial; rank 0 then adds the
    recipe, renames it into place and removes all but the last KEEP checkpoints."""
    final = step_dir(out, step)
    if final.exists():  # this very state was saved already (a rerun of a finished step)
        return final
    tmp = final.with_name(final.name + PARTIAL)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp))
    if rank == 0:
        with open(tmp / RECIPE, "w") as f:
            json.dump(recipe, f, indent=1)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        for d in finished(out)[:-KEEP]:
            shutil.rmtree(d, ignore_errors=True)
    _barrier()
    return final


def load(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path))


def save_best(weights: dict, meta: dict, out, rank: int) -> None:
    """Rank 0 writes the consolidated draft into best.partial, then swaps it in."""
    from safetensors.torch import save_file

    if rank == 0:
        best = Path(out) / BEST
        tmp, old = best.with_name(BEST + PARTIAL), best.with_name(BEST + ".old")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            str(tmp / BEST_WEIGHTS),
            {"format": "pt"},
        )
        with open(tmp / BEST_META, "w") as f:
            json.dump(meta, f, indent=1)
        if best.exists():
            os.replace(best, old)
        os.replace(tmp, best)
        fsync_dir(best.parent)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
