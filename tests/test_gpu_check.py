"""benchmarks/gpu_check.py in its CPU smoke mode: the reference-check, draft-training and storage
paths run end to end at tiny sizes and print the figures table (the real run needs a GPU)."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_smoke_mode_on_cpu(capsys, tmp_path):
    args = ["--device", "cpu", "--small", "--storage-dir", str(tmp_path), "--write-gib", "0.01"]
    assert load_gpu_check().main(args) == 0
    out = capsys.readouterr().out
    assert "| check | size | figure | peak GPU memory |" in out
    reference_rows = [line for line in out.splitlines() if line.startswith("| reference layer")]
    assert len(reference_rows) == 4 and all(", ok |" in line for line in reference_rows), out
    assert "| reference forward (fp32, all layers) |" in out
    draft_rows = [line for line in out.splitlines() if line.startswith("| draft training |")]
    assert len(draft_rows) == 2, out  # the llama draft and the MLA draft
    assert all("tok/s" in row and "ms/step" in row for row in draft_rows), out
    assert "small mla" in draft_rows[1], out
    host_rows = [line for line in out.splitlines() if line.startswith("| states to host")]
    assert len(host_rows) == 2 and all("MiB" in line for line in host_rows), out
    assert "bf16" in host_rows[0] and "fp8" in host_rows[1]
    write_rows = [line for line in out.splitlines() if line.startswith("| row writes")]
    assert len(write_rows) == 2 and all("CPU-s/GB" in line for line in write_rows), out
    assert "O_DIRECT" in write_rows[0] and "(0 MiB direct" in write_rows[1]
    # The rows lie in page-aligned memory: where the filesystem takes O_DIRECT, none is copied.
    assert "(0 MiB direct" in write_rows[0] or "of which 0 MiB copied" in write_rows[0]
    assert list(tmp_path.iterdir()) == []  # the written files are removed


def test_gpu_check_draft_rig_at_kimi_shape_on_meta():
    """The training part's set-up at the shape the GPU run trains (Kimi-K2.5's draft), built
    without memory, and the plan its peak is compared with."""
    g = load_gpu_check()
    assert ("kimi-k2.5", g.KIMI_K25_TEXT, (4096, 8192)) in g.DRAFT_CASES
    rig = g.draft_rig(g.KIMI_K25_TEXT, 32000, torch.device("meta"))
    cfg = rig.cfg
    assert (cfg.hidden_size, cfg.intermediate_size, len(rig.model.layers)) == (7168, 18432, 1)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.num_aux) == (163840, 32000, 3)
    assert cfg.attention == "flex" and rig.train.ttt_steps == 3
    assert rig.head.lm_head.shape == (32000, 7168) and rig.head.lm_head.dtype == torch.bfloat16
    for n_tokens in (4096, 8192):
        plan = rig.plan(n_tokens)
        assert plan.workload == g.Workload(n_tokens, 3, 1, "cuda")
        assert plan.trainable_params == rig.trainable
        assert 20 * g.GB < plan.total < 0.9 * 79 * g.GB  # fits an H100 without checkpointing


def test_gpu_check_mla_draft_rig_at_kimi_shape_on_meta():
    """The MLA draft's training step at Kimi-K2.5's shape (64 heads, q_lora 1536, kv_lora 512,
    q.k over 128 + 64, v 128), on the meta device, and the plan its peak is compared with."""
    g = load_gpu_check()
    assert ("kimi-k2.5 mla", g.KIMI_K25_MLA_TEXT, (4096,)) in g.MLA_DRAFT_CASES
    rig = g.draft_rig(g.KIMI_K25_MLA_TEXT, 32000, torch.device("meta"), "mla")
    cfg = rig.cfg
    assert (cfg.decoder, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (
        "mla",
        64,
        1536,
        512,
    )
    assert (cfg.head_dim, cfg.v_head_dim) == (192, 128)
    assert type(rig.model.layers[0].self_attn).__name__ == "MLAAttention"
    plan = rig.plan(4096)
    assert plan.trainable_params == rig.trainable == 896_169_984
    assert 20 * g.GB < plan.total < 0.9 * 79 * g.GB  # fits an H100 without checkpointing


def test_gpu_check_draft_rig_steps_at_a_tiny_shape_on_cpu():
    g = load_gpu_check()
    name, target, (n_tokens,) = g.SMALL_DRAFT_CASES[0]
    rig = g.draft_rig(target, 256, torch.device("cpu"))
    batch = g.synthetic_batch(target, n_tokens, rig.layout, rig.train.ttt_steps, seed=0)
    before = rig.model.fc.weight.detach().clone()
    assert math.isfinite(rig.step(batch))
    assert not torch.equal(before, rig.model.fc.weight)
    assert rig.plan(n_tokens).workload.device_type == "cpu"


def test_gpu_check_imports_without_vllm():
    """The GPU machine has PyTorch but no vLLM: nothing the script imports may need it."""
    script = str(REPO / "benchmarks" / "gpu_check.py")
    code = (
        "import sys, importlib.util; sys.modules['vllm'] = None; "
        f"spec = importlib.util.spec_from_file_location('g', {script!r}); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    )
