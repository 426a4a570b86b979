import pytest

from support.target_configs import DEEPSEEK_V3, fake_checkpoint


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
    return fake_checkpoint(
        tmp_path / "DeepSeek-V3",
        DEEPSEEK_V3,
        tokenizer_dir,
        "model.norm.weight",
        "model-00001-of-000163.safetensors",
    )


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
