"""The installed vLLM's CPU rotary kernel, checked against a float64 reference, before and after
eagleflow's fix (the fix is applied only where the self-test finds the kernel wrong)."""

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_cpu_rope_fix_rotates_3d_queries_like_the_reference():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    from eagleflow.engine.vllm_fixes import _gptj_rotate, cpu_rope_3d_is_wrong, fix_cpu_rope

    assert fix_cpu_rope()
    assert not cpu_rope_3d_is_wrong()
    # DeepSeek's call: the rope part of [tokens, heads, 96] queries as a strided 3-D view, and the
    # shared key as a [tokens, 1, 64] view of the latent; both rotated, the rest untouched.
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(64, 64, 2048, 10000.0, False, torch.float32)
    positions = torch.arange(40)
    q, latent = torch.randn(40, 4, 96), torch.randn(40, 1, 576)
    q_pe, k_pe = rope.forward_cpu(positions, q[..., 32:], latent[:, :, 512:])
    assert torch.allclose(q_pe.double(), _gptj_rotate(q[..., 32:], positions, 10000.0), atol=1e-4)
    assert torch.allclose(
        k_pe.double(), _gptj_rotate(latent[:, :, 512:], positions, 10000.0), atol=1e-4
    )


def test_fixed_worker_extension_applies_the_fix_where_it_is_imported():
    """vLLM imports `worker_extension_cls` in the processes it spawns (engine core, TP workers),
    which do not inherit a patch made in the caller: importing the extension must fix the kernel."""
    import subprocess
    import sys

    code = (
        "from eagleflow.engine.vllm_fixes import cpu_rope_3d_is_wrong; assert "
        "cpu_rope_3d_is_wrong(); "
        "import eagleflow.engine.fixed_worker; assert not cpu_rope_3d_is_wrong()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_worker_extension_asks_for_amx_where_it_is_imported():
    """A fresh process has no AMX permission until it asks; importing the worker extension (as
    vLLM does in every process it spawns) asks, before any model is built."""
    import subprocess
    import sys

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX")
    code = (
        "from eagleflow.engine.vllm_fixes import amx_permitted; assert not amx_permitted(); "
        "import eagleflow.engine.fixed_worker; assert amx_permitted()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
