"""Extraction throughput against the engine's own limit, side by side, in one invocation.

On the same target, samples and engine settings (one engine, so start-up is paid once and
reported apart), alternating at least three times each and compared by medians:
  1. plain vLLM prefill of the shard's samples (`max_tokens=1`, no capture): the engine's limit;
  2. eagleflow's extraction of the same samples: the shard file created, capture, rows written
     into it in place with their chunk commits, and the file linked into place.
Prints tokens per second for each, their ratio (last line `ratio=<value>`), bytes written per
second, where the extraction's wall time went, and the peak resident memory of the whole
process tree (driver, engine, workers) while extracting a shard and one four times larger.
Also the seconds spent inside the model's forward in each arm (the engine runs in this
process at TP=1): both arms run the same forward, so what differs there is the machine's noise or
interference with the forward, and what differs outside it is eagleflow's own work.
The verification read that follows every extraction (and hashes the file) is timed apart: it
is the same read in any storage design, and no engine time. So the wall ratio leaves it out;
the CPU-time ratio (`cpu_ratio`) counts it, as the extract job pays it, and is also printed
without it.

The target is the embedded architecture (DeepseekV3, MLA + MoE) at a larger hidden size,
built by the same fixture code, so compute dominates Python overhead.

Usage: .venv/bin/python benchmarks/extract_throughput.py [--tokens 8000] [--repeats 3]
       [--storage-dtype float8_e4m3fn]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import psutil  # noqa: E402  (a vLLM dependency)

from eagleflow.capture.plan import make_plan  # noqa: E402
from eagleflow.data.conversations import Conversation  # noqa: E402
from eagleflow.data.shards import build_shards  # noqa: E402
from eagleflow.data.templating import tokenize_conversation, tokenizer_digest  # noqa: E402
from eagleflow.embedded.bundled_data import generate_conversations  # noqa: E402
from eagleflow.embedded.tiny_target import build_tiny_target  # noqa: E402
from eagleflow.engine.settings import EngineSettings  # noqa: E402
from eagleflow.extract.shard import (  # noqa: E402
    Timings,
    finish_shard,
    prepare_shard_file,
    run_chunks,
    start_capture_engine,
)
from eagleflow.store.chunks import ShardChunks  # noqa: E402
from eagleflow.store.verify import Expected, verify_shard  # noqa: E402
from eagleflow.target.info import count_parameters, read_target  # noqa: E402
from eagleflow.target.layers import default_layer_ids  # noqa: E402

# The embedded architecture, four times wider (MLA latent sizes stay what the CPU kernel needs).
BENCH_ARCH = dict(
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=256,
)


def process_tree() -> list:
    """This process and its descendants (engine core, workers)."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


class PeakRSS:
    """Peak resident memory of this process and its descendants (engine core, workers) during
    the block: each process's kernel high-water mark (VmHWM), reset on entry through
    /proc/<pid>/clear_refs, summed on exit. The sum is an upper bound of the tree's peak, and
    no sampling thread takes CPU from the arm it measures."""

    def __enter__(self):
        self.peak = 0
        for p in process_tree():
            with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS to the current RSS
        return self

    def __exit__(self, *exc):
        for p in process_tree():
            with open(f"/proc/{p.pid}/status") as f:
                hwm = next(line for line in f if line.startswith("VmHWM:"))
            self.peak += int(hwm.split()[1]) * 1024


class ForwardClock:
    """Seconds inside the model's forward, summed, in this process's engine (TP=1, one process):
    the class's forward is wrapped, so the capture (installed afterwards) wraps the timed one."""

    def __init__(self, llm):
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        cls = type(model)
        inner = cls.forward
        self.seconds = 0.0
        self.tokens = []  # tokens of each forward since the last lap

        def timed(model_self, input_ids, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(model_self, input_ids, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.tokens.append(-1 if input_ids is None else int(input_ids.shape[0]))

        cls.forward = timed

    def lap(self) -> float:
        """Seconds since the last lap (and `forwards`: the tokens of each forward in it)."""
        seconds, self.seconds = self.seconds, 0.0
        self.forwards, self.tokens = self.tokens, []
        return seconds


def tree_cpu_seconds() -> float:
    """User + system CPU seconds used so far by this process and its descendants (engine core,
    workers): the engine's own cost, far less sensitive than wall time to other jobs' load."""
    total = 0.0
    for p in process_tree():
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def tree_minor_faults() -> int:
    """Minor page faults so far of this process and its descendants (Linux /proc): each is a
    page the kernel handed out anew. Where a virtual machine returns freed memory to its host,
    such a page also faults on the host, which makes it many times dearer (fresh_page_writes.py)."""
    total = 0
    for p in process_tree():
        try:
            stat = Path(f"/proc/{p.pid}/stat").read_text()
        except OSError:
            continue
        total += int(stat.rsplit(")", 1)[1].split()[7])  # field 10, minflt
    return total


def make_shard(tokenizer, n_tokens: int, seed: int):
    """Bundled conversations, several joined per sample (about 100-600 tokens), up to n_tokens."""
    rows = generate_conversations(n_tokens // 4, seed)
    convs, toks, total, i = [], [], 0, 0
    while i < len(rows):
        k = 4 + (i % 17)
        msgs = tuple(m for r in rows[i : i + k] for m in r["messages"])
        t = tokenize_conversation(tokenizer, msgs, 600)
        if total + len(t.input_ids) > n_tokens:
            break
        convs.append(Conversation(f"bench-{seed}-{i}", msgs, "bench", i))
        toks.append(t)
        total += len(t.input_ids)
        i += k
    return build_shards(convs, toks, len(convs), tokenizer_digest(tokenizer))[0]


def plain_prefill(llm, shard) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [
        TokensPrompt(prompt_token_ids=shard.sample(j)[0].tolist())
        for j in range(len(shard.sample_ids))
    ]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - t0


def eagleflow_extract(llm, shard, plan, workdir: Path, chunk_tokens: int):
    out = workdir / f"{shard.shard_id}.safetensors"
    chunks = ShardChunks.plan(shard, plan.fingerprint, out, chunk_tokens)
    timings = Timings()
    t0 = time.perf_counter()
    with timings.phase("prepare"):
        shard_file = prepare_shard_file(chunks, plan, "bfloat16")
    run_chunks(llm, chunks, list(range(len(chunks.ranges))), plan, shard_file, timings)
    with timings.phase("finish"):
        size = finish_shard(chunks, out)
    seconds = time.perf_counter() - t0
    record = {"bytes": size, "fingerprint": plan.fingerprint, "shard_id": shard.shard_id}
    t1, c1 = time.perf_counter(), tree_cpu_seconds()
    result = verify_shard(out, shard, record, Expected.of(plan, "bfloat16"))
    assert result["ok"], result["problems"]
    timings.seconds["verify_read_apart"] = time.perf_counter() - t1
    timings.seconds["verify_read_cpu"] = tree_cpu_seconds() - c1
    return seconds, size, timings.seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens", type=int, default=8000, help="tokens in the small shard (the large one has 4x)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="1x,4x", help="which shards to run: 1x, 4x or both")
    ap.add_argument("--chunk-tokens", type=int, default=4096)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/eagleflow-throughput-bench"))
    ap.add_argument(
        "--storage-dtype",
        default="bfloat16",
        choices=["bfloat16", "float8_e4m3fn"],
        help="capture.storage_dtype of the extraction arm",
    )
    args = ap.parse_args()
    target = args.workdir / "target"
    if not (target / "model.safetensors").exists():
        rows = generate_conversations(3000)
        build_tiny_target([m["content"] for r in rows for m in r["messages"]], target, **BENCH_ARCH)
    info = read_target(target)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    build = {
        "1x": lambda: make_shard(tokenizer, args.tokens, 1),
        "4x": lambda: make_shard(tokenizer, 4 * args.tokens, 2),
    }
    shards = {name: build[name]() for name in args.sizes.split(",")}
    plan = make_plan(
        info, default_layer_ids(info.num_layers), "auto", storage_dtype=args.storage_dtype
    )
    plan = replace(plan, fingerprint="bench")
    max_len = max(int(max(s.offsets[1:] - s.offsets[:-1])) for s in shards.values()) + 1
    settings = EngineSettings(
        target=str(target), max_model_len=max_len, max_num_batched_tokens=8192
    )
    print(
        f"target: DeepseekV3ForCausalLM, {info.num_layers} layers, hidden {info.hidden_size}, "
        f"{count_parameters(info) / 1e6:.0f}M parameters (MLA, 8 routed + 1 shared experts), "
        "bf16, TP=1 CPU"
    )
    print(
        f"capture: layer ids {plan.layer_ids}, strategy {plan.strategy.value}, "
        f"chunk_tokens {args.chunk_tokens}, storage {plan.storage_dtype}"
    )
    for name, s in shards.items():
        lengths = s.offsets[1:] - s.offsets[:-1]
        print(
            f"shard {name}: {len(s.sample_ids)} samples, {len(s.input_ids)} tokens "
            f"({int(lengths.min())}-{int(lengths.max())} per sample)"
        )
    t0 = time.perf_counter()
    llm = start_capture_engine(settings, plan, args.workdir / "engine")
    print(f"engine start (paid once per job): {time.perf_counter() - t0:.1f} s")
    clock = ForwardClock(llm)
    llm.collective_rpc("eagleflow_uninstall")  # reinstalled on the timed forward
    llm.collective_rpc("eagleflow_install", args=(plan.to_json(),))
    sched = llm.llm_engine.vllm_config.scheduler_config
    # Both arms run on this one engine, so they share every setting. vLLM's CPU platform decides
    # the batching of MLA models by the CPU: without AMX it turns chunked prefill off and sets
    # max_num_batched_tokens itself; with AMX (its AMX_MLA backend) it keeps both. Hence printed
    # as found.
    print(
        f"engine settings (both arms): max_num_batched_tokens {sched.max_num_batched_tokens}, "
        f"max_num_seqs {sched.max_num_seqs}, chunked prefill {sched.enable_chunked_prefill}, "
        f"prefix caching {llm.llm_engine.vllm_config.cache_config.enable_prefix_caching}, "
        f"max_model_len {settings.max_model_len}"
    )
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    # Warm-up, not measured: first calls allocate and fault in memory.
    plain_prefill(llm, next(iter(shards.values())))
    clock.lap()
    results = {}
    for name, shard in shards.items():
        n = len(shard.input_ids)
        plain, ours, written, phases, peaks, loads = [], [], [], [], [], []
        plain_cpu, ours_cpu, ours_cpu_no_verify, plain_peaks = [], [], [], []
        plain_fwd, ours_fwd = [], []  # (seconds in the forward, seconds outside it) per run
        plain_faults, ours_faults = [], []  # minor page faults per run, process tree
        plain_batches, ours_batches = [], []  # tokens of each forward, per run

        def run_plain():
            # Plain runs without the capture wrapper (its per-forward copy is eagleflow's cost).
            llm.collective_rpc("eagleflow_uninstall")
            c0, f0 = tree_cpu_seconds(), tree_minor_faults()
            clock.lap()
            with PeakRSS() as mem:
                seconds = plain_prefill(llm, shard)
            plain_faults.append(tree_minor_faults() - f0)
            forward = clock.lap()
            plain_batches.append(clock.forwards)
            plain.append(n / seconds)
            plain_fwd.append((forward, seconds - forward))
            plain_cpu.append(n / (tree_cpu_seconds() - c0))
            plain_peaks.append(mem.peak)
            llm.collective_rpc("eagleflow_install", args=(plan.to_json(),))

        def run_ours():
            # The last run's file goes before the clocks start: deleting it is the benchmark's
            # work, not the extraction's.
            shutil.rmtree(args.workdir / "out", ignore_errors=True)
            c0, f0 = tree_cpu_seconds(), tree_minor_faults()
            clock.lap()
            with PeakRSS() as mem:
                seconds, size, ph = eagleflow_extract(
                    llm, shard, plan, args.workdir / "out", args.chunk_tokens
                )
            ours_faults.append(tree_minor_faults() - f0)
            forward = clock.lap()
            ours_batches.append(clock.forwards)
            ours_fwd.append((forward, seconds - forward))
            cpu = tree_cpu_seconds() - c0
            ours_cpu.append(n / cpu)
            ours_cpu_no_verify.append(n / (cpu - ph["verify_read_cpu"]))
            ours.append(n / seconds)
            written.append(size / seconds)
            phases.append(ph)
            peaks.append(mem.peak)

        for rep in range(args.repeats):
            # Alternate which arm goes first, so neither always follows the other.
            for run in (run_plain, run_ours) if rep % 2 == 0 else (run_ours, run_plain):
                run()
            loads.append(os.getloadavg()[0])
        p, o = statistics.median(plain), statistics.median(ours)
        results[name] = {
            "tokens": n,
            "plain_tok_s": p,
            "eagleflow_tok_s": o,
            "ratio": o / p,
            "plain_runs": plain,
            "eagleflow_runs": ours,
            "load_1min": loads,
            "plain_tok_per_cpu_s": statistics.median(plain_cpu),
            "eagleflow_tok_per_cpu_s": statistics.median(ours_cpu),
            "cpu_ratio": statistics.median(ours_cpu) / statistics.median(plain_cpu),
            "cpu_ratio_without_verify": statistics.median(ours_cpu_no_verify)
            / statistics.median(plain_cpu),
            "bytes_per_s": statistics.median(written),
            "peak_rss": max(peaks),
            "plain_peak_rss": max(plain_peaks),
            "phases": {k: statistics.median(x[k] for x in phases) for k in phases[0]},
            "plain_forward_and_rest_s": plain_fwd,
            "plain_minor_faults": plain_faults,
            "eagleflow_minor_faults": ours_faults,
            "eagleflow_forward_and_rest_s": ours_fwd,
        }
        print(
            f"shard {name} ({n} tokens): plain {p:.0f} tok/s "
            f"[{', '.join(f'{x:.0f}' for x in plain)}], "
            f"eagleflow {o:.0f} tok/s [{', '.join(f'{x:.0f}' for x in ours)}], ratio {o / p:.3f}, "
            f"written {statistics.median(written) / 2**20:.1f} MiB/s, peak RSS "
            f"{max(peaks) / 2**30:.2f} GiB "
            f"(plain {max(plain_peaks) / 2**30:.2f} GiB), "
            f"load average {min(loads):.1f}-{max(loads):.1f}"
        )
        print(
            f"  per CPU-second of the process tree (load-insensitive): plain "
            f"{statistics.median(plain_cpu):.1f} "
            f"[{', '.join(f'{x:.1f}' for x in plain_cpu)}], eagleflow "
            f"{statistics.median(ours_cpu):.1f} "
            f"[{', '.join(f'{x:.1f}' for x in ours_cpu)}] tok/cpu-s, cpu_ratio "
            f"{results[name]['cpu_ratio']:.3f} (without the verification read "
            f"{results[name]['cpu_ratio_without_verify']:.3f})"
        )

        def split(runs):
            return (
                f"{statistics.median(f for f, _ in runs):.2f} in the forward "
                f"[{', '.join(f'{f:.2f}' for f, _ in runs)}], "
                f"{statistics.median(r for _, r in runs):.2f} outside "
                f"[{', '.join(f'{r:.2f}' for _, r in runs)}]"
            )

        print(
            f"  minor page faults per run (median, process tree; verification included): "
            f"plain {statistics.median(plain_faults):,.0f}, "
            f"eagleflow {statistics.median(ours_faults):,.0f}"
        )
        print(
            f"  tokens per forward, first run: plain {plain_batches[0]}, "
            f"eagleflow {ours_batches[0]}"
        )
        print(f"  seconds per run (median), plain: {split(plain_fwd)}")
        print(f"  seconds per run (median), eagleflow: {split(ours_fwd)}")
        print(
            "  where the extraction's time went (median s): "
            + ", ".join(f"{k} {v:.2f}" for k, v in results[name]["phases"].items())
        )
    if len(results) == 2:
        print(
            "peak RSS, 4x shard vs 1x shard: "
            f"{results['4x']['peak_rss'] / results['1x']['peak_rss']:.2f}"
        )
    (args.workdir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"ratio={min(r['ratio'] for r in results.values()):.3f}")


if __name__ == "__main__":
    main()
