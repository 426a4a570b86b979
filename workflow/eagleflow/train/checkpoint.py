"""Checkpoints, `best/` and resume of a draft training run: one module owns their layout and
their order (`Checkpoints`), under the trainer's output directory:

    checkpoints/step-00000120/        the latest finished checkpoint (and the one before it,
                                      kept in case this one is lost): ONE
                                      `torch.distributed.checkpoint` save of every Stateful
                                      component (model, optimizer, progress, rng), each rank
                                      writing its own shards (`__<rank>_0.distcp`, `.metadata`)
        recipe.json                   what decides the weights (`plan.settings.recipe_of`:
                                      settings, data, draft, vocabulary): a rerun resumes only
                                      when its own recipe equals this one
    checkpoints/step-00000160.partial/  a save in progress: never read, removed on start
    best/                             the draft with the best simulated acceptance length,
                                      consolidated for export (`eagleflow.draft.weights`)

A checkpoint is written into `<name>.partial` by every rank and renamed into place by rank 0
once all ranks have written (DCP's save ends with a collective that writes `.metadata`), and
the folder is fsynced after the rename, so a kill (or a crash of the machine) at any moment
leaves either the previous checkpoint or the new one, never a half-written one taken for
finished. Frozen tensors (the target's embedding, its norm and lm_head) are in no
checkpoint: they are read again from the target. DCP reshards on load, so a checkpoint
resumes at any world size (FSDP or a single process).

Resume (`Checkpoints.resume`): the latest checkpoint is loaded when its recipe is this run's
and its step lies within the run. Otherwise the run starts from step 0 and every checkpoint,
`best/` and `progress.json` are removed first: none of them is this run's, and a checkpoint
of the old run left at a step this run reaches would be taken for this run's.

`best/` (`Checkpoints.offer_best`): a validated draft is kept when its simulated acceptance
length beats the best so far, when there are no held-out samples (the last draft), or when
`best/` is not there (lost after the run finished: the draft at hand is written again).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from eagleflow.draft.weights import META as BEST_META
from eagleflow.draft.weights import WEIGHTS as BEST_WEIGHTS
from eagleflow.draft.weights import trainable, write_draft
from eagleflow.store.locks import fsync_dir
from eagleflow.train.parallel import all_reduce_sums, barrier

CHECKPOINTS, BEST, RECIPE = "checkpoints", "best", "recipe.json"
PROGRESS = "progress.json"  # eagleflow.train.records writes it, once a checkpoint is saved
PARTIAL = ".partial"
KEEP = 2  # finished checkpoints kept: the latest and the one before it
__all__ = ["BEST_META", "BEST_WEIGHTS", "Checkpoints", "Progress"]


# ---------------------------------------------------------------- what a checkpoint holds


class ModelAndOptimizer:
    """Stateful: the draft's trainable weights and its optimizers, FQN-keyed (DCP reshards
    them to any world size, FSDP or not)."""

    def __init__(self, model, optims):
        self.model, self.optims = model, optims

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=True)
        model_state, optim_state = get_state_dict(self.model, self.optims, options=options)
        return {"model": trainable(model_state), "optim": optim_state}

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.model,
            self.optims,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=False, ignore_frozen_params=True),
        )


@dataclass
class Progress:
    """Stateful: where the run is (the data position is the step: `PackPlan`) and what it
    has done. The learning rate is a function of the step, the total and `warmup_steps`,
    which the run's first total fixed (an extended run keeps it)."""

    step: int = 0
    tokens_trained: int = 0  # loss-masked target tokens trained on
    samples_trained: int = 0
    best_step: int = 0
    best: dict | None = None  # the best evaluation so far (`objective.figures`)
    warmup_steps: int | None = None  # None: a checkpoint from before it was kept

    def state_dict(self):  # one JSON string: DCP would flatten `best` into keys of its own
        return {"json": json.dumps(asdict(self))}

    def load_state_dict(self, state):
        for k, v in json.loads(state["json"]).items():
            setattr(self, k, v)


class RngState:
    """Stateful: the CPU generator. Training draws from no global generator (the noise has a
    generator of its own per pack, `objective.noise_generator`); kept for the checkpoints'
    format, and so that anything drawing from it later resumes exactly."""

    def state_dict(self):
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state):
        torch.set_rng_state(state["cpu"])


def training_state(model, optims, progress: Progress) -> dict:
    """Every Stateful component, as one DCP save holds them."""
    return {"train": ModelAndOptimizer(model, optims), "progress": progress, "rng": RngState()}


def full_weights(model) -> dict:
    """The trainable weights and vocab maps, whole, on the CPU (rank 0's under FSDP)."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
    else:
        state = model.state_dict()
    return {k: v.detach().cpu() for k, v in trainable(state).items()}


# ---------------------------------------------------------------- the folder


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


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kw)


class Checkpoints:
    """Save, resume and `best/` of one run in `out`; every rank calls every method."""

    def __init__(self, out, rank: int, recipe: dict, log=print):
        self.out, self.rank, self.recipe, self.log = Path(out), rank, recipe, log
        self.total = 0  # the run's steps (`resume`)

    def clean(self) -> None:
        """Remove saves that never finished (a kill during a save)."""
        root = self.out / CHECKPOINTS
        best, old = self.out / BEST, self.out / (BEST + ".old")
        if self.rank == 0:
            if root.is_dir():
                for d in root.iterdir():
                    if d.name.endswith(PARTIAL):
                        shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(best.with_name(BEST + PARTIAL), ignore_errors=True)
            if old.exists():
                if best.exists():
                    shutil.rmtree(old)
                else:  # killed between the two renames of `write_draft`: the old one stands
                    os.replace(old, best)
        barrier()

    def resume(self, state: dict, total: int) -> int:
        """Load the latest checkpoint when it belongs to this run (module doc); its step, or
        0 after removing what another run left."""
        self.total = total
        self.clean()
        path = latest(self.out)
        if path is None:
            self._start_afresh()
            return 0
        changed = changed_keys(read_recipe(path), self.recipe)
        step = checkpoint_step(path)
        if changed:
            self.log(
                f"{path}: written for another training run ({', '.join(changed)} changed); "
                "training from step 0"
            )
        elif step > total:
            self.log(
                f"{path}: at step {step}, past this run's end ({total} steps: epochs or "
                "max_steps reduced); training from step 0"
            )
        else:
            _quiet(dcp.load, state, checkpoint_id=str(path))
            self.log(f"resuming from {path} (step {step} of {total})")
            return state["progress"].step
        self._start_afresh()
        return 0

    def _start_afresh(self) -> None:
        """No checkpoint, best draft or progress record of another run stays behind."""
        if self.rank == 0:
            shutil.rmtree(self.out / CHECKPOINTS, ignore_errors=True)
            shutil.rmtree(self.out / BEST, ignore_errors=True)
            (self.out / PROGRESS).unlink(missing_ok=True)
        barrier()

    def save(self, state: dict, step: int) -> Path:
        """Every rank writes its part of `state` into step-N.partial; rank 0 then adds the
        recipe, renames it into place and removes all but the last KEEP checkpoints."""
        final = step_dir(self.out, step)
        if final.exists():  # this run's very state (a rerun of a finished step: `resume`)
            return final
        tmp = final.with_name(final.name + PARTIAL)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
        barrier()
        _quiet(dcp.save, state, checkpoint_id=str(tmp))
        if self.rank == 0:
            with open(tmp / RECIPE, "w") as f:
                json.dump(self.recipe, f, indent=1)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            for d in finished(self.out)[:-KEEP]:
                shutil.rmtree(d, ignore_errors=True)
        barrier()
        return final

    def best_missing(self, device) -> bool:
        """`best/` is not there (rank 0 looks; every rank gets its answer)."""
        missing = float(self.rank == 0 and not (self.out / BEST).exists())
        return all_reduce_sums([missing], device)[0] > 0

    def offer_best(self, model, progress: Progress, step: int, metrics, meta: dict) -> bool:
        """Keep the draft in best/ when the module doc's rule says so; True when kept.
        `metrics`: the validation's figures (None: no held-out samples); `meta` goes into
        draft.json with the step and the figures."""
        best = (progress.best or {}).get("simulated_acceptance_length", -1.0)
        if metrics is not None:
            keep = metrics["simulated_acceptance_length"] > best
        else:
            keep = step == self.total  # the last draft
        device = next(model.parameters()).device
        if not keep and self.best_missing(device):
            self.log(f"{self.out / BEST} is missing: the draft of step {step} is kept there")
            keep = True
        if not keep:
            return False
        progress.best, progress.best_step = metrics, step
        al = metrics and metrics["simulated_acceptance_length"]
        meta = meta | {"step": step, "simulated_acceptance_length": al, "validation": metrics}
        weights = full_weights(model)
        if self.rank == 0:
            write_draft(weights, meta | {"recipe": self.recipe}, self.out / BEST)
        barrier()
        return True
