"""The draft trainer's settings (`draft.*` in the workflow config), torch-free: the workflow
reads them while it plans (`eagleflow.plan.resources`, `eagleflow.plan.launch`)."""

from __future__ import annotations

from dataclasses import dataclass

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
