import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tokenizer():
    from eagleflow.embedded.bundled_data import generate_conversations
    from eagleflow.embedded.tiny_target import train_tokenizer

    rows = generate_conversations(300, seed=1)
    return train_tokenizer([m["content"] for r in rows for m in r["messages"]], vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def fake_deepseek_v3(tmp_path, tokenizer_dir):
    """DeepSeek-V3's real config.json and a tokenizer, weights reduced to one small file: a
    stand-in for the GPU examples' `target.path` (tests/test_examples.py, test_docs_commands.py)."""
    import torch
    from safetensors.torch import save_file
    from test_target import DEEPSEEK_V3

    d = tmp_path / "DeepSeek-V3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    for p in Path(tokenizer_dir).iterdir():
        shutil.copy(p, d / p.name)
    save_file(
        {"model.norm.weight": torch.ones(7168, dtype=torch.bfloat16)},
        str(d / "model-00001-of-000163.safetensors"),
    )
    return d


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


@pytest.fixture(scope="session")
def extracted_workdir(tmp_path_factory):
    """The embedded default (small: 4 shards) extracted once through real vLLM, shared by tests
    that only read it; tests that change it work on a copy (`copy_workdir`)."""
    import time

    from support.workflow_runner import SMALL, snakemake

    workdir = tmp_path_factory.mktemp("run")
    t0 = time.time()
    snakemake(workdir, "extract", config=SMALL)
    print(f"end-to-end extract on the small default: {time.time() - t0:.0f} s")
    return workdir
