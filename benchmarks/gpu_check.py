"""GPU checks that need no vLLM: the reference-check path and draft-training throughput.

The GPU machine lent for checks (one H200) has PyTorch but no vLLM, so this script covers
what runs without it, at realistic sizes, and prints one figures table:

  (a) reference check (`eagleflow.capture.reference`): a DeepseekV3 target at DeepSeek-V3's widths
      (hidden 7168, MLA with q_lora 1536 / kv_lora 512 / 128 heads, vocab 129,280; fewer
      layers and experts so it fits one GPU), random weights. "Captured" states are the
      same forward in bf16 (what vLLM computes; vLLM itself is not on that machine), stored
      in the shard layout; `check_shard_against_reference` recomputes them in float32 and
      reports per-layer error and the reference forward's throughput.
  (b) draft training (`eagleflow.draft.model` + `eagleflow.train.trainer` pieces): the EAGLE-3
      draft at Kimi-K2.5's shape (hidden 7168, intermediate 18,432, one layer, 32k draft
      vocabulary over the target's 163,840) at 4k and 8k tokens per pack, and a
      Llama-3-8B-sized one (hidden 4096), as the trainer takes a step on one GPU: bf16
      autocast, compiled flex attention, AdamW, 3 TTT steps; step time, tokens/s per GPU, and
      peak GPU memory (`torch.cuda.max_memory_allocated`) against the memory plan's estimate
      for the same workload at world size 1 (`eagleflow.train.memory_plan.plan_memory`).
  (b') sequence splitting's attention: a slice of a pack's queries (offset BlockMask,
      compiled flex on CUDA), forward and backward, against the dense reference.
  (c) storage (`eagleflow.store.quant.states_to_host`, `eagleflow.store.direct_io`): one
      forward's states at Kimi-K2.5's widths (4 layers x 7168, bf16) brought to the host as
      the capture worker does (into pinned memory), in bf16 and quantized to fp8 on the
      device first, and bf16 into pageable memory for comparison (ms per forward, bytes);
      then those rows written into a file on this machine's disk with
      O_DIRECT and through the page cache, as `ShardFile.write_rows` does (GB/s, CPU seconds
      per GB, each file new, fdatasync included).

Usage (from the repository root):
  python benchmarks/gpu_check.py                        # one H200, under 8 minutes
  python benchmarks/gpu_check.py --skip-reference --skip-draft --storage-dir /tmp  # (c) only
  python benchmarks/gpu_check.py --device cpu --small   # smoke mode: tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import torch  # noqa: E402

from eagleflow.capture.reference import check_shard_against_reference, reference_states  # noqa: E402
from eagleflow.draft.model import DraftConfig, Eagle3Draft, attend, kernel_for, pack_mask  # noqa: E402
from eagleflow.plan.settings import TrainConfig  # noqa: E402
from eagleflow.store.direct_io import ALIGN, DirectWriter  # noqa: E402
from eagleflow.store.quant import states_to_host  # noqa: E402
from eagleflow.target.head import TargetHead  # noqa: E402
from eagleflow.target.layers import default_layer_ids  # noqa: E402
from eagleflow.train.data import ShardLayout, build_batch  # noqa: E402
from eagleflow.train.memory_plan import GB, MemoryPlan, Workload, plan_memory  # noqa: E402
from eagleflow.train.objective import figures  # noqa: E402
from eagleflow.train.optimizer import build_optimizers  # noqa: E402
from eagleflow.train.parallel import Parallelism  # noqa: E402
from eagleflow.train.sequence_parallel import slice_length  # noqa: E402
from eagleflow.train.step import StepContext, train_step  # noqa: E402

# DeepSeek-V3's widths; depth and expert count cut so the float32 reference fits one GPU.
REFERENCE_TARGET = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
SMALL_TARGET = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=8,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
# Draft targets: (name, target config fields the draft is sized from, tokens per pack to try).
# Kimi-K2.5's text model (`text_config`): the draft the issue sizes (26), at 4k and 8k.
KIMI_K25_TEXT = dict(
    hidden_size=7168, intermediate_size=18432, vocab_size=163840, num_hidden_layers=61
)
DRAFT_CASES = [
    ("kimi-k2.5", KIMI_K25_TEXT, (4096, 8192)),
    (
        "llama-3-8b",
        dict(hidden_size=4096, intermediate_size=14336, vocab_size=128256, num_hidden_layers=32),
        (2048, 4096, 8192),
    ),
]
SMALL_DRAFT_CASES = [
    (
        "small",
        dict(hidden_size=64, intermediate_size=128, vocab_size=512, num_hidden_layers=8),
        (64,),
    ),
]
# The MLA draft (`draft.architecture: mla`, shaped by the target's MLA): Kimi-K2.5's at 4k
# (compiled flex with q.k over 192 dimensions and v over 128), and a tiny one for the smoke mode.
MLA_SHAPE = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64)
KIMI_K25_MLA_TEXT = dict(KIMI_K25_TEXT, num_attention_heads=64, v_head_dim=128, **MLA_SHAPE)
MLA_DRAFT_CASES = [("kimi-k2.5 mla", KIMI_K25_MLA_TEXT, (4096,))]
SMALL_MLA_DRAFT_CASES = [
    (
        "small mla",
        dict(
            SMALL_DRAFT_CASES[0][1],
            num_attention_heads=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
        ),
        (64,),
    )
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def sample_offsets(n_samples: int, length: int, seed: int) -> list[int]:
    """Sample boundaries: lengths spread over [length/2, length] (a chat shard is not uniform)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (n_samples,), generator=g)
    return [0] + torch.cumsum(lengths, 0).tolist()


def build_target(fields: dict, device: torch.device):
    """A random-weight DeepseekV3ForCausalLM (float32) built directly on `device`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**fields)
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config)
    return model.float().eval()


def run_reference(args, device: torch.device) -> list[dict]:
    """(a) bf16 'captured' states vs the float32 reference, through eagleflow.capture.reference."""
    import copy

    fields = SMALL_TARGET if args.small else REFERENCE_TARGET
    n_samples, length = (2, 16) if args.small else (args.ref_samples, args.ref_length)
    import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401 - import apart from build time

    reset_peak(device)
    t0 = time.perf_counter()
    model = build_target(fields, device)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    sync(device)
    build_s = time.perf_counter() - t0
    L = fields["num_hidden_layers"]
    layer_ids = default_layer_ids(L)
    offsets = sample_offsets(n_samples, length, seed=1)
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, fields["vocab_size"], (offsets[-1],), generator=g).numpy()
    # What extraction would have stored: bf16 states [T, n_layers, H] in the shard layout.
    t0 = time.perf_counter()
    captured = torch.cat(
        [
            reference_states(model_bf16, input_ids[a:b], layer_ids)
            for a, b in zip(offsets[:-1], offsets[1:])
        ]
    ).to(torch.bfloat16)
    sync(device)
    capture_s = time.perf_counter() - t0
    del model_bf16
    t0 = time.perf_counter()
    stats = check_shard_against_reference(
        model, captured, input_ids, offsets, layer_ids, list(range(n_samples))
    )
    sync(device)
    check_s = time.perf_counter() - t0
    n_tok = offsets[-1]
    size = (
        f"hidden {fields['hidden_size']}, {L} layers, {fields['n_routed_experts']} experts, "
        f"{n_samples} samples / {n_tok} tokens"
    )
    print(
        f"reference target: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
        f"built in {build_s:.1f} s; layer ids {layer_ids}"
    )
    rows = []
    for s in stats:
        rows.append(
            {
                "check": f"reference layer {s.layer_id}",
                "size": size,
                "figure": (
                    f"median rel err {s.median_rel_err:.4f}, p95 {s.p95_rel_err:.4f}, "
                    f"mean cos {s.mean_cosine:.5f}, neighbour {s.shifted_median_rel_err:.3f}, "
                    f"closer to own {s.closer_to_own:.2f}, "
                    f"{'ok' if s.ok else 'FAIL'}"
                ),
                "peak_gib": peak_gib(device),
            }
        )
    rows.append(
        {
            "check": "reference forward (fp32, all layers)",
            "size": size,
            "figure": f"{n_tok / check_s:,.0f} tok/s ({check_s:.2f} s); bf16 capture "
            f"{n_tok / capture_s:,.0f} tok/s",
            "peak_gib": peak_gib(device),
        }
    )
    del model
    return rows


class DraftRig(NamedTuple):
    """What one draft-training case trains with, built as `eagleflow.train.trainer` builds it:
    the draft (flex attention: compiled on CUDA), the target's head rows over the draft
    vocabulary in bf16, the optimizers of draft.optimizer. (A NamedTuple, not a dataclass:
    the tests load this script without registering it as a module.)"""

    cfg: DraftConfig
    layout: ShardLayout
    model: Eagle3Draft
    head: TargetHead
    optims: list[torch.optim.Optimizer]
    train: TrainConfig

    @property
    def trainable(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def step(self, batch) -> float:
        """One optimizer step on one pack exactly as the trainer takes it (states dequantized
        on the device, autocast bf16 on CUDA, clipped update); the pack's loss."""
        ctx = StepContext(self.train, Parallelism(0, 1, self.device))
        result = train_step(self.model, self.head, self.optims, [batch], ctx)
        return figures(result.sums, self.train.step_weight)["loss"]

    @property
    def device(self) -> torch.device:
        return self.head.lm_head.device

    def plan(self, n_tokens: int) -> MemoryPlan:
        """The memory plan's estimate for one rank training packs of `n_tokens` (a rig on the
        meta device stands for the GPU run)."""
        device_type = "cuda" if self.device.type == "meta" else self.device.type
        return plan_memory(self.cfg, Workload(n_tokens, self.train.ttt_steps, 1, device_type))


def draft_rig(
    target: dict, draft_vocab: int, device: torch.device, decoder: str = "llama"
) -> DraftRig:
    """The draft sized for `target` (config fields) on `device` (meta: shapes only);
    `decoder`: llama, or mla (`draft.architecture`)."""
    n_layers = target["num_hidden_layers"]
    ids = default_layer_ids(n_layers)
    layout = ShardLayout([], ids, n_layers, [i for i in ids if i != n_layers])
    cfg = DraftConfig.for_target(target, draft_vocab, len(layout.aux_ids), decoder=decoder)
    train = TrainConfig()
    torch.manual_seed(0)
    with torch.device(device):
        model = Eagle3Draft(cfg)
        g = None if device.type == "meta" else torch.Generator(device).manual_seed(3)
        rows = torch.randn(draft_vocab, cfg.hidden_size, generator=g) * 0.02
        head = TargetHead(torch.ones(cfg.hidden_size), rows, cfg.rms_norm_eps, torch.bfloat16)
    return DraftRig(cfg, layout, model, head, build_optimizers(model, train), train)


def synthetic_batch(target: dict, n_tokens: int, layout: ShardLayout, steps: int, seed: int):
    """A pack of n_tokens rows with the stored layout: bf16 states [N, n_layers, H]."""
    g = torch.Generator().manual_seed(seed)
    offsets = sample_offsets(n_tokens, max(8, n_tokens // 4), seed)
    starts = [o for o in offsets if o < n_tokens]
    ids = torch.randint(0, target["vocab_size"], (n_tokens,), generator=g)
    mask = torch.rand(n_tokens, generator=g) < 0.7
    hidden = torch.randn(n_tokens, len(layout.layer_ids), target["hidden_size"], generator=g).to(
        torch.bfloat16
    )
    return build_batch(ids, mask, hidden, starts, layout, steps)


def run_draft(args, device: torch.device) -> list[dict]:
    """(b) draft-training step time, tokens/s and peak memory against the plan."""
    cases = [(*c, "llama") for c in (SMALL_DRAFT_CASES if args.small else DRAFT_CASES)]
    cases += [(*c, "mla") for c in (SMALL_MLA_DRAFT_CASES if args.small else MLA_DRAFT_CASES)]
    draft_vocab = 256 if args.small else 32000
    rows = []
    for name, target, token_counts, decoder in cases:
        rig = draft_rig(target, draft_vocab, device, decoder)
        cfg, steps = rig.cfg, rig.train.ttt_steps
        for n_tokens in token_counts:
            size = (
                f"{name}: hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
                f"{rig.trainable / 1e6:.0f}M trainable, {n_tokens} tok/step, TTT {steps}"
            )
            plan = rig.plan(n_tokens)
            print(f"{name}, {n_tokens} tokens: {plan.describe()}")
            batch = synthetic_batch(target, n_tokens, rig.layout, steps, seed=n_tokens).to(device)
            reset_peak(device)
            try:
                for _ in range(args.warmup):
                    rig.step(batch)
                sync(device)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    loss = rig.step(batch)
                sync(device)
                seconds = (time.perf_counter() - t0) / args.steps
            except torch.OutOfMemoryError:
                figure = f"out of memory; plan {plan.total / GB:.1f} GiB"
                rows.append(
                    {
                        "check": "draft training",
                        "size": size,
                        "figure": figure,
                        "peak_gib": peak_gib(device),
                    }
                )
                for optim in rig.optims:
                    optim.zero_grad(set_to_none=True)
                del batch
                reset_peak(device)
                continue
            peak = peak_gib(device)
            vs_plan = "" if peak is None else f", peak / plan {peak * GB / plan.total:.2f}"
            rows.append(
                {
                    "check": "draft training",
                    "size": size,
                    "figure": (
                        f"{n_tokens / seconds:,.0f} tok/s per GPU, {seconds * 1000:.0f} ms/step, "
                        f"loss {loss:.3f}; plan {plan.total / GB:.1f} GiB{vs_plan}"
                    ),
                    "peak_gib": peak,
                }
            )
            del batch
        del rig
    return rows


def run_slice_attention(args, device: torch.device) -> list[dict]:
    """(b') sequence splitting's attention (`draft.sequence_parallel`): the second half of a
    pack's queries through the kernel the trainer uses on this device (compiled flex on
    CUDA, with the slice's offset BlockMask), forward and backward, against the dense
    reference's rows of the whole pack (float32)."""
    n = 600 if args.small else 8192
    heads, kv_heads, d = (4, 2, 16) if args.small else (56, 8, 128)
    g = torch.Generator().manual_seed(0)
    lengths = [n // 4, n // 8, 1, n // 2]
    lengths.append(n - sum(lengths))
    doc = torch.cat([torch.full((m,), i) for i, m in enumerate(lengths)]).to(device)
    q = torch.randn(heads, n, d, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(kv_heads, n, d, generator=g).to(device).requires_grad_() for _ in "kv")
    kd, vd = (torch.randn(kv_heads, n, d, generator=g).to(device) for _ in "kv")  # step 1
    half = slice_length(n, 2)
    rows = slice(half, n)
    ref = attend(q, [(k, v), (kd, vd)], pack_mask(doc, "dense"), 0.1)[:, rows]
    (ref_grad,) = torch.autograd.grad(ref.sum(), [q])
    kernel = kernel_for("flex", device)
    sync(device)
    t0 = time.perf_counter()
    out = attend(
        q[:, rows],
        [(k, v), (kd[:, rows], vd[:, rows])],
        pack_mask(doc, kernel, half, n - half),
        0.1,
    )
    (grad,) = torch.autograd.grad(out.sum(), [q])
    sync(device)
    seconds = time.perf_counter() - t0
    err = max((out - ref).abs().max().item(), (grad - ref_grad).abs().max().item())
    return [
        {
            "check": "sequence-split attention",
            "size": f"{kernel}, {n} tokens, queries {half}..{n - 1}, {heads} heads x {d}",
            "figure": (
                f"max abs diff to dense {err:.2e} (fwd+bwd, fp32); "
                f"{seconds * 1000:.0f} ms incl. compile"
            ),
            "peak_gib": peak_gib(device),
        }
    ]


def layer_states(n_tokens: int, hidden: int, n_layers: int, device: torch.device) -> list:
    """One forward's aux states: [n_tokens, hidden] bf16 per layer, magnitudes growing with
    depth by orders as a real target's do (fp8 scales are per token and layer)."""
    g = torch.Generator(device=device).manual_seed(0)
    return [
        (torch.randn(n_tokens, hidden, generator=g, device=device) * 10.0**k).bfloat16()
        for k in range(n_layers)
    ]


def pageable_to_host(aux, n: int, fp8: bool) -> tuple:
    """As `states_to_host` in bf16, but into new pageable host memory per forward (the path
    before pinned memory: a comparison arm)."""
    return (torch.stack([a[:n] for a in aux], dim=1).to("cpu"),)


def run_storage(args, device: torch.device) -> list[dict]:
    """(c) device-to-host per forward in both storage dtypes, and the row writes."""
    n_tokens, hidden, n_layers = (256, 64, 4) if args.small else (args.capture_tokens, 7168, 4)
    aux = layer_states(n_tokens, hidden, n_layers, device)
    rows, host = [], {}
    arms = [
        ("bf16", False, states_to_host),
        ("fp8 (quantized on the device)", True, states_to_host),
    ]
    if device.type == "cuda":
        arms.append(("bf16 into pageable memory (not eagleflow's path)", False, pageable_to_host))
    for name, fp8, to_host in arms:
        reset_peak(device)
        for _ in range(args.warmup):
            to_host(aux, n_tokens, fp8)
        sync(device)
        times = []
        for _ in range(max(args.steps, 3)):
            t0 = time.perf_counter()
            cols = to_host(aux, n_tokens, fp8)
            sync(device)
            times.append(time.perf_counter() - t0)
        seconds = sorted(times)[len(times) // 2]
        moved = sum(c.numel() * c.element_size() for c in cols)
        host[name] = cols
        rows.append(
            {
                "check": "states to host, per forward",
                "size": f"{n_tokens} tokens x {n_layers} layers x {hidden}, {name}",
                "figure": (
                    f"{seconds * 1000:.1f} ms (median of {len(times)}), "
                    f"{moved / 2**20:,.0f} MiB, {moved / seconds / 1e9:.1f} GB/s"
                ),
                "peak_gib": peak_gib(device),
            }
        )
    if args.storage_dir is None:
        return rows
    # The bf16 rows as `states_to_host` left them, written `--write-gib` worth into a new sparse
    # file per arm, after a header of one page as in a shard file.
    (states,) = host["bf16"]
    data = memoryview(states.view(torch.uint8).reshape(-1).numpy())
    repeats = max(1, round(args.write_gib * 2**30 / len(data)))
    header = ALIGN
    for name, direct in (("O_DIRECT", True), ("page cache", False)):
        path = Path(args.storage_dir) / f"gpu_check_rows_{direct}.bin"
        with open(path, "wb") as f:
            f.truncate(header + repeats * len(data))
        t0, c0 = time.perf_counter(), time.thread_time()
        with DirectWriter(path, direct=direct) as out:
            for i in range(repeats):
                out.write(data, header + i * len(data))
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        path.unlink()
        gb = repeats * len(data) / 1e9
        rows.append(
            {
                "check": "row writes, fdatasync included",
                "size": f"{gb:.1f} GB into a new file in {args.storage_dir}, {name}",
                "figure": (
                    f"{gb / wall:.2f} GB/s, {cpu / gb:.3f} CPU-s/GB "
                    f"({out.direct_bytes / 2**20:,.0f} MiB direct, of which "
                    f"{out.bounced_bytes / 2**20:,.0f} MiB copied to an aligned buffer first)"
                ),
                "peak_gib": None,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--small", action="store_true", help="tiny sizes: a smoke run for any device")
    ap.add_argument("--ref-samples", type=int, default=8)
    ap.add_argument(
        "--ref-length", type=int, default=1024, help="longest reference sample (tokens)"
    )
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed draft-training steps per case")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--skip-storage", action="store_true")
    ap.add_argument(
        "--capture-tokens", type=int, default=16384, help="tokens of one forward in (c)"
    )
    ap.add_argument(
        "--storage-dir", help="write (c)'s rows into a new file here (default: no writes)"
    )
    ap.add_argument("--write-gib", type=float, default=4.0, help="GiB of rows per write arm")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; run with --device cpu --small for the smoke mode", file=sys.stderr)
        return 2
    if args.small:
        args.warmup, args.steps = 1, 1
        if device.type == "cpu":
            torch.set_num_threads(
                1
            )  # tiny tensors: threads only add contention on a shared machine
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    print(
        f"device: {device} ({name}); torch {torch.__version__}; "
        f"{'small' if args.small else 'full'} sizes"
    )
    t_start = time.perf_counter()
    rows = []
    if not args.skip_reference:
        rows += run_reference(args, device)
    if not args.skip_draft:
        rows += run_slice_attention(args, device)
        rows += run_draft(args, device)
    if not args.skip_storage:
        rows += run_storage(args, device)
    print()
    print("| check | size | figure | peak GPU memory |")
    print("|---|---|---|---|")
    for r in rows:
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
        print(f"| {r['check']} | {r['size']} | {r['figure']} | {peak} |")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
