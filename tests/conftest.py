import fcntl
import os
import shutil
import time
from pathlib import Path

# OMP_WAIT_POLICY stays libgomp's default here. With PASSIVE (sleeping waits, set for the
# whole run at 3b5ea69) a DataLoader worker forked from a pytest worker deadlocked in
# gomp_team_barrier_wait_end on its first indexing op: libgomp's thread pool is not fork-safe
# and the copy's team barrier waits for threads that do not exist in the child. CI then ran
# to its 90-minute limit; the run before that setting passed (docs/testing.md).
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


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(directory)` done once per test run, by whichever process asks first (pytest-xdist
    workers wait on a lock meanwhile), in a directory every worker sees; tests read it, or
    work on a copy (`support.workflow_runner.copy_workdir`)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the run's workers
    directory, done = base / name, base / f"{name}.built"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when its holder ends, however it ends
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def reference_deepseek(tmp_path_factory):
    """The tiny DeepseekV3 target trained on the reference corpus, once per test run (the
    reference, pipeline-parallel and multi-node tests read it; none writes to it), with its
    mixed-length shard (`support.references.Built`)."""
    from eagleflow.embedded.tiny_target import build_tiny_target
    from support.references import built, reference_corpus

    return built(
        built_once(
            tmp_path_factory,
            "reference-deepseek",
            lambda d: build_tiny_target(reference_corpus(), d),
        )
    )


@pytest.fixture(scope="session")
def prepared_workdir(tmp_path_factory):
    """The embedded default (small: 4 shards) up to its extraction, once per test run: the
    bundled dataset, the target built, the shards, validation and the capture plan
    (`snakemake prepare`, no model load). A test that extracts from scratch starts from a copy
    (`copy_workdir`): what its config changes (shard size, engine or capture settings) reruns
    there, the rest is this run's."""
    from support.workflow_runner import SMALL, snakemake

    return built_once(
        tmp_path_factory, "prepared-default", lambda w: snakemake(w, "prepare", config=SMALL)
    )


@pytest.fixture(scope="session")
def extracted_workdir(tmp_path_factory, prepared_workdir):
    """The embedded default (small: 4 shards) extracted once per test run through real vLLM,
    shared by the tests that read it; tests that run Snakemake on it or change it work on a
    copy (`copy_workdir`)."""
    from support.workflow_runner import SMALL, copy_workdir, snakemake

    def extract(workdir):
        t0 = time.time()
        copy_workdir(prepared_workdir, workdir)
        snakemake(workdir, "extract", config=SMALL)
        print(f"end-to-end extract on the small default: {time.time() - t0:.0f} s")

    return built_once(tmp_path_factory, "extracted-default", extract)


# The test files that take longest, longest first (per-file sums of the measured runs in
# docs/measurements/test-suite.md): under pytest-xdist (`--dist loadfile`) each starts as
# early as it can instead of running alone at the end. The others follow in their own order.
LONGEST_FIRST = (
    "test_slurm.py",
    "test_engine_reuse.py",
    "test_draft.py",
    "test_regenerate_workflow.py",
    "test_kimi_traffic.py",  # 1021 s alone (-n 0, shared machine): replica, 3 Snakemake runs
    "test_train_distributed.py",
    "test_storage.py",
    "test_pipeline_parallel.py",
    "test_resume.py",
    "test_reference.py",
    "test_stream.py",
    "test_caching.py",
    "test_multinode.py",
    "test_regenerate.py",
    "test_mla_draft.py",  # 273 s alone (-n 0), two in-process trainer runs and vLLM's module
)


def pytest_collection_modifyitems(items):
    """The files of LONGEST_FIRST first, in its order; each file's tests in their own order."""

    def rank(item):
        name = Path(str(item.fspath)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their collection order
