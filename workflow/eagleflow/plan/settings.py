"""The draft trainer's settings (`draft.*` in the workflow config), torch-free: the workflow
reads them while it plans (`eagleflow.plan.resources`, `eagleflow.plan.launch`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from eagleflow.data.heldout import HELDOUT_MODULUS
from eagleflow.target.info import TargetError, draft_architecture_for, read_target

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
# both the workflow (a change reruns train_draft: `DraftSettings.recipe`) and the trainer (a
# change restarts from step 0: `recipe_of`) read.
RECIPE_KEYS = tuple(f.name for f in fields(TrainConfig) if f.name not in EXTENT_KEYS + RUNTIME_KEYS)


# `draft.architecture: mla`: the MLA draft's shape keys (null: the target's), which a llama
# draft refuses (`eagleflow.draft.mla.MLA_SHAPE_KEYS` and the heads)
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_KEYS += ("num_attention_heads",)
ARCHITECTURES = ("auto", "llama", "mla")  # draft.architecture (auto: the target decides)
# DraftConfig fields that decide what the weights mean, for every architecture; an MLA draft
# adds `architecture` and MLA_KEYS (`DraftSettings.recipe`)
ARCH_KEYS = ("fc_norm", "norm_output")
DRAFT_KEYS = ("attention", "activation_checkpointing", *ARCH_KEYS)  # DraftConfig overrides
STATES = ("stored", "stream", "cached")  # draft.states (docs/streaming.md)


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
class DraftModel:
    """The DraftConfig overrides of `draft:` (`eagleflow.draft.model.draft_config_for`):
    `fc_norm` and `norm_output` decide what the weights mean (`ARCH_KEYS`, recipe); the
    attention kernel and activation checkpointing only how they are computed (runtime)."""

    attention: str
    activation_checkpointing: bool
    fc_norm: bool
    norm_output: bool
    architecture: str = "auto"  # draft.architecture: the decoder layer (auto | llama | mla)
    mla_shape: dict = field(default_factory=dict)  # the MLA_KEYS set (unset: the target's)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise SettingsError(
                f"draft.architecture = {self.architecture!r}: one of {', '.join(ARCHITECTURES)}"
            )
        if self.architecture != "mla" and self.mla_shape:
            raise SettingsError(
                f"draft.{next(iter(self.mla_shape))} is an MLA shape key: it needs "
                "draft.architecture: mla"
            )

    def overrides(self) -> dict:
        """The keywords `draft_config_for` takes, as the trainer's `--draft` flag carries them
        (`architecture` is DraftConfig's `decoder`, auto resolved against the target by
        `draft_config_for`; a llama draft's are those it always had)."""
        out = {k: getattr(self, k) for k in DRAFT_KEYS}
        if self.architecture != "llama":
            out |= {"decoder": self.architecture, **self.mla_shape}
        return out


@dataclass(frozen=True)
class StatesSource:
    """Where the trainer's hidden states come from (`draft.states` and its stream settings,
    docs/streaming.md): runtime, the packs and token ids are the same in the three modes."""

    mode: str  # stored | stream | cached
    cache_bytes: int  # cached: the most bytes the state cache may hold
    scratch_dir: str  # draft.stream_dir: a memory filesystem for one pack's states
    engine_devices: str | None  # draft.stream_engine_devices: CUDA devices the engine takes
    tcp: bool  # draft.stream_tcp
    tls: bool  # draft.stream_tls, only over TCP

    def __post_init__(self):
        if self.mode not in STATES:
            raise SettingsError(f"draft.states = {self.mode!r}: one of {', '.join(STATES)}")

    @property
    def stored(self) -> bool:
        """The extracted shards are read; otherwise the capture server prefills the states."""
        return self.mode == "stored"


@dataclass(frozen=True)
class Ranks:
    """How many ranks train and where (`draft.nodes` x `draft.processes_per_node`): runtime,
    the global batch is in packs (`eagleflow.plan.resources.TrainJob` sizes the job)."""

    device: str  # cuda | cpu: draft.device, where auto follows extract.device
    nodes: int
    processes_per_node: int | None  # None: 1 on CPU, every GPU of a node on CUDA
    cpus_per_rank: int | None  # None: 8 per GPU rank, num_workers + 1 on CPU
    tokens_per_second_per_rank: float  # the assumed rate until a checkpoint measures one


@dataclass(frozen=True)
class DraftSettings:
    """The workflow's `draft:` section, typed and built once from the validated config
    (`from_config`); every rule, script and check reads this, not the dict. What each key is:

    - the recipe (`RECIPE_KEYS` of `train`, `ARCH_KEYS` of `model`): they decide the weights;
      a change re-runs train_draft, which restarts from step 0 (`recipe_of`);
    - the extent (`EXTENT_KEYS`): a change re-runs it, which resumes;
    - runtime: the rest of `train` (intervals, data loading, sequence splitting), `states`
      and `ranks`: they change how a run goes, not what it makes.

    `train.heldout_modulus` is `data.heldout_modulus`, the one route by which the draft's
    rules (vocabulary, trainer, progress) learn which samples are held out."""

    train: TrainConfig
    model: DraftModel
    states: StatesSource
    ranks: Ranks
    vocab_size: int  # draft vocabulary (draft_vocab; recipe through the vocabulary file)
    speculative_tokens: int  # what the exported config asks vLLM for (export_draft)

    @classmethod
    def from_config(cls, config: dict) -> DraftSettings:
        """From the workflow config after schema validation (every key has its default)."""
        draft = config["draft"]
        device = draft["device"]
        if device == "auto":
            device = config["extract"]["device"]
        device = "cuda" if device.startswith("cuda") else "cpu"
        names = {f.name for f in fields(TrainConfig)}
        train = {k: v for k, v in draft.items() if k in names}
        train["heldout_modulus"] = config["data"]["heldout_modulus"]
        # the trainer's device: each rank takes cuda:LOCAL_RANK (auto), or the CPU
        train["device"] = "auto" if device == "cuda" else "cpu"
        return cls(
            train=TrainConfig(**train),
            model=DraftModel(
                **{k: draft[k] for k in DRAFT_KEYS},
                architecture=draft["architecture"],
                mla_shape={k: draft[k] for k in MLA_KEYS if draft.get(k) is not None},
            ),
            states=StatesSource(
                mode=draft["states"],
                cache_bytes=int(draft["cache_bytes"]),
                scratch_dir=draft["stream_dir"],
                engine_devices=draft["stream_engine_devices"],
                tcp=draft["stream_tcp"],
                tls=draft["stream_tcp"] and draft["stream_tls"],
            ),
            ranks=Ranks(
                device=device,
                nodes=int(draft["nodes"]),
                processes_per_node=draft["processes_per_node"],
                cpus_per_rank=draft["cpus_per_rank"],
                tokens_per_second_per_rank=float(draft["tokens_per_second_per_rank"]),
            ),
            vocab_size=int(draft["vocab_size"]),
            speculative_tokens=int(draft["speculative_tokens"]),
        )

    @property
    def heldout_modulus(self) -> int:
        return self.train.heldout_modulus

    def recipe(self) -> dict:
        """train_draft's params: the settings that decide the weights or the run's extent, so
        that a change to one of them (and to nothing else) runs the job again (it then resumes
        or restarts, as its checkpoint's recipe decides: `recipe_of`). The keys sorted, then
        `heldout_modulus`: the order these params always had, so that Snakemake's record of a
        finished run still matches and nobody's training reruns. A key added to the recipe
        (a new `ARCH_KEYS` entry) changes these params for every finished run, and so reruns
        it: leave it out while it holds the value older drafts were trained with."""
        names = sorted((set(RECIPE_KEYS) | set(EXTENT_KEYS)) - {"heldout_modulus"})
        values = {k: getattr(self.train, k) for k in names}
        values |= {k: getattr(self.model, k) for k in ARCH_KEYS}
        # a llama draft's params stay what they were; auto's draft follows the target, an input
        if self.model.architecture != "llama":
            values |= {"architecture": self.model.architecture}
        if self.model.architecture == "mla":
            values |= {k: self.model.mla_shape.get(k) for k in MLA_KEYS}
        return {k: values[k] for k in sorted(values)} | {"heldout_modulus": self.heldout_modulus}


def check_architecture(config: dict) -> None:
    """`draft.architecture` against the evaluation, before the DAG: an MLA draft is evaluated
    by vLLM with MLA on (the CPU KV cache of the MLA target and the MLA draft has no common
    block size with MLA off). An auto draft is checked here when the target's config.json
    exists; an embedded target's, not yet built, by the evaluation
    (`eagleflow.evaluate.acceptance.engine_for_draft`)."""
    ev = config["evaluate"]
    if ev["mla"] is not False or "vllm_eagle3" not in ev["paths"]:
        return
    architecture = config["draft"]["architecture"]
    if architecture == "mla":
        raise SettingsError(
            "draft.architecture mla is served by vLLM's Eagle3DeepseekV2ForCausalLM, which "
            "runs only with MLA on: set evaluate.mla: true"
        )
    if architecture == "auto":
        try:  # an embedded target is built later: the evaluation checks it then
            target = read_target(config["target"]["path"])
        except TargetError:
            return
        if draft_architecture_for(target.text_config) == "mla":
            raise SettingsError(
                f"draft.architecture auto trains an MLA draft for {target.path} "
                f"({target.architecture}), which vLLM serves only with MLA on, and "
                "evaluate.mla is false: set evaluate.mla to null or true, or "
                "draft.architecture to llama"
            )
