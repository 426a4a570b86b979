"""The draft trainer's settings (`draft.*` in the workflow config), torch-free: the workflow
reads them while it plans (`eagleflow.plan.resources`, `eagleflow.plan.launch`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from eagleflow.data.heldout import HELDOUT_MODULUS

LOSSES = ("kl", "lk_hybrid")
LM_HEADS = ("random", "target", "target_frozen")
OPTIMIZERS = ("adamw", "muon")


@dataclass
class TrainConfig:
    """Every training setting (`draft.*` in the workflow config). Defaults from the anchors:
    speculators 0.9 (`src/speculators/train/`) and SpecForge 0.3 (`scripts/train_eagle3.py`)."""

    epochs: int = 3  # lightseekorg's Kimi-K2.5 draft (3); speculators' maintainers: 2-3
    max_steps: int = 0  # 0: every step of `epochs`; N: the run (and its schedule) ends at N
    batch_packs: int = 8  # packs per optimizer step over all ranks: the anchors' 8 GPUs x 1
    max_tokens: int = 8192  # tokens per pack (speculators' packed `total_seq_len`)
    max_sample_tokens: int = 0  # 0: every sample trained in full; N: longer ones not trained
    sequence_parallel: int = 1  # ranks that train one pack, each a slice (SpecForge: sp size)
    ttt_steps: int = 3  # speculators `--ttt-steps` (SpecForge: 7)
    step_weight: float = 0.8  # loss weight of TTT step k: step_weight**k (EAGLE-3)
    loss: str = "kl"  # "kl": forward KL(target || draft); "lk_hybrid": the LK paper's blend
    noise_std: float = 0.0  # Gaussian noise on the aux states, x each state's RMS (training)
    mask_oov: bool = False  # no loss where the next token is outside the draft vocabulary
    lm_head: str = "random"  # "target": init from the target's rows; "target_frozen": kept
    lr: float = 1e-4  # speculators and SpecForge
    warmup_ratio: float = 0.015  # SpecForge (speculators: 0.01)
    min_lr_ratio: float = 0.0  # both decay to 0 (SpecForge cosine, speculators linear)
    weight_decay: float = 0.01  # speculators' AdamW
    optimizer: str = "adamw"  # "muon": Muon on the hidden 2D matrices, AdamW on the rest
    muon_lr: float = 0.02  # Muon's peak lr (Keller Jordan's; speculators' TrainerConfig)
    muon_weight_decay: float = 0.1  # speculators' and torch's Muon
    grad_clip: float = 0.5  # SpecForge `--max-grad-norm` (speculators: 1.0)
    eval_every: int = 500  # steps between validations (and at the end); 0: at the end only
    eval_samples: int = 2048  # held-out samples validated on (a seeded subset); 0: all
    save_every: int = 500  # steps between checkpoints (and at the end)
    seed: int = 0  # the draft's initialisation and the data order
    num_workers: int = 4  # DataLoader workers per rank (SpecForge: 4, speculators: 12)
    prefetch_factor: int = 4  # packs each worker reads ahead (speculators)
    device: str = "auto"  # auto: cuda:LOCAL_RANK when CUDA is there, else cpu
    device_memory_gb: float = 0.0  # the memory plan's limit; 0: the device's own (CUDA)
    stall_timeout: float = 0.0  # s a rank may wait before it fails; 0: sized from its steps
    heldout_modulus: int = HELDOUT_MODULUS  # held-out samples (eagleflow.data.heldout)

    def __post_init__(self):
        for key in ("epochs", "batch_packs", "ttt_steps", "save_every", "sequence_parallel"):
            if getattr(self, key) < 1:
                raise ValueError(f"draft.{key} = {getattr(self, key)}: must be at least 1")
        if self.max_tokens < 16:
            raise ValueError(f"draft.max_tokens = {self.max_tokens}: must be at least 16")
        if self.loss not in LOSSES:
            raise ValueError(f"draft.loss = {self.loss!r}: one of {', '.join(LOSSES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"draft.optimizer = {self.optimizer!r}: one of {', '.join(OPTIMIZERS)}"
            )
        if self.stall_timeout < 0:
            raise ValueError(
                f"draft.stall_timeout = {self.stall_timeout}: seconds above 0, or 0 for the "
                "automatic limit"
            )
        if self.muon_lr <= 0:
            raise ValueError(f"draft.muon_lr = {self.muon_lr}: must be above 0")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"draft.lm_head = {self.lm_head!r}: one of {', '.join(LM_HEADS)}")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("draft.warmup_ratio must be in [0, 1), draft.min_lr_ratio in [0, 1]")


# What may change between a checkpoint and its rerun without a restart: the run's extent
# (resumed when the checkpoint lies within it) and settings that do not touch the weights.
EXTENT_KEYS = ("epochs", "max_steps")
RUNTIME_KEYS = ("eval_every", "eval_samples", "save_every", "num_workers", "prefetch_factor")
RUNTIME_KEYS += ("device", "device_memory_gb", "sequence_parallel", "stall_timeout")
# What decides the trained weights: every other TrainConfig field. The one definition that
# both the workflow (a change reruns train_draft: `eagleflow.plan.launch.recipe_settings`) and
# the trainer (a change restarts from step 0: `recipe_of`) read.
RECIPE_KEYS = tuple(f.name for f in fields(TrainConfig) if f.name not in EXTENT_KEYS + RUNTIME_KEYS)


# `draft.architecture: mla`: the MLA draft's shape keys (null: the target's), which a llama
# draft refuses (`eagleflow.draft.mla.MLA_SHAPE_KEYS` and the heads)
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_KEYS += ("num_attention_heads",)
# DraftConfig fields that decide what the weights mean
ARCH_KEYS = ("fc_norm", "norm_output", "architecture", *MLA_KEYS)
DRAFT_KEYS = ("attention", "activation_checkpointing", *ARCH_KEYS)  # DraftConfig overrides


def draft_overrides(draft: dict) -> dict:
    """The DraftConfig overrides of the `draft` section: what the trainer, the check before
    launch and the job's memory plan pass to `eagleflow.draft.model.draft_config_for`.
    `architecture` is DraftConfig's `decoder`; an MLA shape key left null takes the target's."""
    overrides = {k: draft[k] for k in DRAFT_KEYS if k in draft and k not in MLA_KEYS}
    architecture = overrides.pop("architecture", "llama")
    shape = {k: draft[k] for k in MLA_KEYS if draft.get(k) is not None}
    if architecture == "mla":
        return {**overrides, "decoder": "mla", **shape}
    if shape:
        raise SettingsError(
            f"draft.{next(iter(shape))} is an MLA shape key: it needs draft.architecture: mla"
        )
    return overrides


def llama_default(draft: dict) -> dict:
    """The `draft` keys without the MLA draft's when the draft is a llama one: they do not
    exist for it, so that train_draft's params are what they were before them."""
    if draft.get("architecture", "llama") != "llama":
        return draft
    return {k: v for k, v in draft.items() if k not in ("architecture", *MLA_KEYS)}


def check_architecture(config: dict) -> None:
    """`draft.architecture` against the rest of the config, before the DAG: the overrides are
    valid, and an MLA draft is evaluated by vLLM with MLA on (the CPU KV cache of the MLA
    target and the MLA draft has no common block size with MLA off)."""
    draft, ev = config["draft"], config["evaluate"]
    draft_overrides(draft)
    mla = draft.get("architecture", "llama") == "mla"
    if mla and not ev["mla"] and "vllm_eagle3" in ev["paths"]:
        raise SettingsError(
            "draft.architecture mla is served by vLLM's Eagle3DeepseekV2ForCausalLM, which "
            "runs only with MLA on: set evaluate.mla: true"
        )


class SettingsError(ValueError):
    """A `draft:` setting that cannot work; its message names the key."""


def recipe_of(cfg: TrainConfig, draft_architecture: dict, layout, vocab) -> dict:
    """Everything that decides the trained weights: a checkpoint is resumed only when all of
    it is unchanged. Not the world size (the global batch is in packs), nor the extent.
    `layout`: the shards' (`ShardLayout`), `vocab`: the draft vocabulary (`DraftVocab`)."""
    return {
        "train_config": {k: getattr(cfg, k) for k in RECIPE_KEYS},
        "draft_config": draft_architecture,
        "shards": [Path(p).name for p in layout.paths],  # content-addressed names
        "layer_ids": list(layout.layer_ids),
        "vocab": vocab.summary(),
    }


def check_world(world: int, batch_packs: int, sequence_parallel: int, streamed=False) -> None:
    """The rules that tie the settings to the ranks, checked here only (by the workflow before
    it launches, `Launch.check`, and by the trainer once it knows its world). `streamed`: the
    states come from the capture server (draft.states stream | cached)."""
    if streamed and sequence_parallel > 1:
        raise SettingsError(
            f"draft.sequence_parallel = {sequence_parallel} with streamed states: every "
            "rank of a pack would prefill it again; set draft.states to stored (or "
            "draft.sequence_parallel to 1)"
        )
    if world % sequence_parallel:
        raise SettingsError(
            f"draft.sequence_parallel = {sequence_parallel} ranks per pack does not divide "
            f"the {world} ranks (draft.nodes x draft.processes_per_node): make it a divisor"
        )
    groups = world // sequence_parallel  # ranks that train different packs
    if batch_packs % groups:
        raise SettingsError(
            f"draft.batch_packs = {batch_packs} packs per optimizer step cannot be split "
            f"over {groups} groups of draft.sequence_parallel = {sequence_parallel} ranks "
            f"({world} = draft.nodes x draft.processes_per_node): set draft.batch_packs to a "
            f"multiple of {groups}"
        )


@dataclass(frozen=True)
class DraftSettings:
    """The workflow's `draft:` section, typed and built once (`from_config`), and what each
    key is: the recipe (`RECIPE_KEYS` and `ARCH_KEYS`: they decide the weights; a change
    re-runs train_draft, which restarts from step 0), the extent (`EXTENT_KEYS`: a change
    re-runs it, which resumes), and the rest, runtime (world size, sequence splitting, states
    source, intervals, data loading: they change how a run goes, not what it makes)."""

    train: TrainConfig
    draft_overrides: dict  # DraftConfig overrides (`DRAFT_KEYS`)
    states: str = "stored"  # stored | stream | cached (docs/streaming.md)

    @classmethod
    def from_config(cls, config: dict, device: str = "cpu") -> DraftSettings:
        """From the workflow config; `device`: where the ranks run (cuda: each rank takes
        cuda:LOCAL_RANK, `auto` in the trainer's settings)."""
        draft = config["draft"]
        names = {f.name for f in fields(TrainConfig)}
        values = {k: v for k, v in draft.items() if k in names}
        values["heldout_modulus"] = config["data"]["heldout_modulus"]
        values["device"] = "auto" if device == "cuda" else "cpu"
        return cls(TrainConfig(**values), draft_overrides(draft), draft.get("states", "stored"))
