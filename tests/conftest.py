import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tokenizer():
    from eagleflow.bundled_data import generate_conversations
    from eagleflow.tiny_target import train_tokenizer

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
