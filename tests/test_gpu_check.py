"""benchmarks/gpu_check.py in its CPU smoke mode: the reference-check and draft-training paths
run end to end at tiny sizes and print the figures table (the real run needs a GPU)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_smoke_mode_on_cpu(capsys):
    assert load_gpu_check().main(["--device", "cpu", "--small"]) == 0
    out = capsys.readouterr().out
    assert "| check | size | figure | peak GPU memory |" in out
    reference_rows = [line for line in out.splitlines() if line.startswith("| reference layer")]
    assert len(reference_rows) == 4 and all(", ok |" in line for line in reference_rows), out
    assert "| reference forward (fp32, all layers) |" in out
    draft_rows = [line for line in out.splitlines() if line.startswith("| draft training |")]
    assert len(draft_rows) == 1 and "tok/s" in draft_rows[0] and "ms/step" in draft_rows[0], out
