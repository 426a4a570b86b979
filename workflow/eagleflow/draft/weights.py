"""A draft's weights in and out: a fresh draft for a target, and the consolidated draft
directory that training keeps as `best/` and export reads.

    <dir>/model.safetensors   trainable weights + d2t/t2d in fp32, no frozen tensor
    <dir>/draft.json          draft config, aux/layer ids, target, vocab, step, AL, recipe

The frozen embedding is in no file: it is the target's, read from the target again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from eagleflow.draft.model import DraftConfig, Eagle3Draft, draft_config_for
from eagleflow.draft.vocab import DraftVocab
from eagleflow.store.locks import fsync_dir
from eagleflow.target.head import EMBED, LM_HEAD, read_target_config, read_target_tensor

WEIGHTS, META = "model.safetensors", "draft.json"
FROZEN_PREFIXES = ("embed_tokens.",)  # the target's embedding: read from the target again


def build_draft(
    target_dir, vocab: DraftVocab, num_aux: int, seed: int, lm_head="random", **draft_overrides
):
    """A fresh draft (seeded init) with the target's embedding and the vocab maps. lm_head
    (`draft.lm_head`): "random" (seeded init, trained), "target" (the target's lm_head rows
    over the draft vocabulary, trained from there) or "target_frozen" (those rows, never
    trained: speculators 0.9's draft)."""
    config = read_target_config(target_dir)
    cfg = draft_config_for(config, vocab.size, num_aux, **draft_overrides)
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.set_vocab(vocab.d2t, vocab.t2d)
    model.set_embedding(read_target_tensor(target_dir, EMBED))
    if lm_head != "random":
        with torch.no_grad():
            model.lm_head.weight.copy_(read_target_tensor(target_dir, LM_HEAD)[vocab.target_ids])
        model.lm_head.weight.requires_grad_(lm_head != "target_frozen")
    return model


def trainable(state: dict) -> dict:
    """`state` without the frozen tensors."""
    return {k: v for k, v in state.items() if not k.startswith(FROZEN_PREFIXES)}


def write_draft(weights: dict, meta: dict, directory) -> None:
    """Write a consolidated draft into `directory` whole: into `<directory>.partial` first,
    then swapped in (the old one kept as `<directory>.old` until the new one is in place)."""
    from safetensors.torch import save_file

    final = Path(directory)
    tmp, old = final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, str(tmp / WEIGHTS), {"format": "pt"})
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def load_trained(path, target_dir=None):
    """(draft, meta) from a trainer's output directory or its `best/`: the best draft's
    weights, with the frozen embedding read again from the target (`target_dir`, else the
    one it was trained against). meta holds `aux_ids`, `step`, `vocab`, `draft_config`..."""
    from safetensors.torch import load_file

    path = Path(path)
    best = path if (path / META).exists() else path / "best"
    with open(best / META) as f:
        meta = json.load(f)
    model = Eagle3Draft(DraftConfig(**meta["draft_config"]))
    missing, unexpected = model.load_state_dict(load_file(str(best / WEIGHTS)), strict=False)
    if unexpected or any(not k.startswith(FROZEN_PREFIXES) for k in missing):
        raise ValueError(f"{best}: weights do not fit the draft ({missing=}, {unexpected=})")
    model.set_embedding(read_target_tensor(target_dir or meta["target"], EMBED))
    return model, meta
