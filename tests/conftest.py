import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tokenizer():
    from eagleflow.fixtures.bundled_data import generate_conversations
    from eagleflow.fixtures.tiny_target import train_tokenizer

    rows = generate_conversations(300, seed=1)
    return train_tokenizer([m["content"] for r in rows for m in r["messages"]], vocab_size=512)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(d)
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
