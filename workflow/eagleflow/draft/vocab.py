"""Draft vocabulary: the most frequent loss-masked target tokens, with vLLM's d2t / t2d maps.

An EAGLE-3 draft predicts over a pruned vocabulary. vLLM 0.32 (`llama_eagle3.py`,
`Eagle3LlamaForCausalLM.compute_logits`) maps draft index i back to the target id

    target_id = i + d2t[i]

(`d2t` is loaded as `draft_id_to_target_id`, int64, one entry per draft index), and
ignores `t2d`, which speculators and the EAGLE reference code save as a bool mask over the
target vocabulary (True where the target id is in the draft vocabulary). The draft ids are
the chosen target ids in ascending order, so `d2t` is non-negative and non-decreasing and
`t2d.nonzero()` lists the same ids in the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DEFAULT_DRAFT_VOCAB_SIZE = 32000


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # [draft_vocab] int64: target_id = draft_idx + d2t[draft_idx]
    t2d: torch.Tensor  # [target_vocab] bool: target id is in the draft vocabulary
    coverage: float  # fraction of loss-masked target tokens inside the draft vocabulary
    masked_tokens: int  # loss-masked tokens counted
    distinct_tokens: int  # distinct loss-masked target ids seen

    @property
    def size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_ids(self) -> torch.Tensor:
        """Target id of every draft index, ascending."""
        return torch.arange(self.size, dtype=torch.long) + self.d2t

    def summary(self) -> dict:
        return {
            "draft_vocab_size": self.size,
            "target_vocab_size": int(self.t2d.numel()),
            "coverage": self.coverage,
            "masked_tokens": self.masked_tokens,
            "distinct_tokens": self.distinct_tokens,
        }


def count_masked_tokens(shard_paths, vocab_size: int, exclude=None) -> torch.Tensor:
    """Counts of every target id over the loss-masked positions of the shards; samples for
    which `exclude(sample_id)` is true (the held-out split) are not counted.

    Reads only `input_ids`, `loss_mask` and `offsets` (small) from each shard, never its
    hidden states.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in shard_paths:
        with safe_open(str(path), framework="pt") as f:
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask").bool()
            if exclude is not None:
                offsets = f.get_tensor("offsets").tolist()
                sample_ids = json.loads((f.metadata() or {}).get("sample_ids", "null"))
                if sample_ids is None or len(sample_ids) != len(offsets) - 1:
                    raise ValueError(f"{path}: metadata `sample_ids` missing or not one per sample")
                for i, sid in enumerate(sample_ids):
                    if exclude(sid):
                        mask[offsets[i] : offsets[i + 1]] = False
        ids = ids[mask]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{path}: token id outside the target vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def vocab_from_counts(counts: torch.Tensor, size: int | None = None) -> DraftVocab:
    """The `size` most frequent ids (ties: lower id first), as d2t / t2d.

    `size` defaults to 32000 and is capped at the target vocabulary; when fewer distinct
    ids were seen, the rest is filled with unseen ids in ascending order (so the draft's
    lm_head has exactly `size` rows).
    """
    vocab_size = counts.numel()
    size = min(DEFAULT_DRAFT_VOCAB_SIZE if size is None else int(size), vocab_size)
    if size < 1:
        raise ValueError(f"draft vocabulary size must be at least 1, got {size}")
    # Stable sort on -count keeps ascending id order among equal counts.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(size, dtype=torch.long)
    total = int(counts.sum())
    coverage = float(counts[chosen].sum()) / total if total else 0.0
    return DraftVocab(d2t, t2d, coverage, total, int((counts > 0).sum()))


def build_draft_vocab(
    shard_paths, vocab_size: int, size: int | None = None, exclude=None
) -> DraftVocab:
    return vocab_from_counts(count_masked_tokens(shard_paths, vocab_size, exclude), size)


def coverage(vocab: DraftVocab, counts: torch.Tensor) -> float:
    """Fraction of the counted tokens (e.g. a held-out shard's) inside the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[vocab.t2d].sum()) / total if total else 0.0


def save_vocab(vocab: DraftVocab, path) -> None:
    """`d2t` / `t2d` in one safetensors file, the summary as metadata and next to it as JSON."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()},
        str(tmp),
        metadata={"summary": json.dumps(vocab.summary())},
    )
    tmp.replace(path)


def load_vocab(path) -> DraftVocab:
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        summary = json.loads(f.metadata()["summary"])
    return DraftVocab(
        tensors["d2t"],
        tensors["t2d"],
        summary["coverage"],
        summary["masked_tokens"],
        summary["distinct_tokens"],
    )
