"""Trains the tiny draft in this process with one loader worker, to the end and then once
raising inside a step, and prints what the runs left behind as JSON: live child processes
and threads other than the main one. Run in a fresh process by
tests/test_trainer_gaps.py::test_a_run_leaves_no_loader_worker_or_watchdog_thread (a fork
from a pytest worker, which runs threads, can deadlock)."""

import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path
from unittest import mock

from eagleflow.draft.vocab import build_draft_vocab
from eagleflow.plan.settings import TrainConfig
from eagleflow.train import trainer
from support.draft_fixtures import TINY_DRAFT, V, write_shard, write_target


def left_behind() -> dict:
    """Child processes and threads still running once the ones that end by themselves had
    time to (a queue's feeder thread ends shortly after its queue is closed)."""
    others = []
    for _ in range(100):
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        if not others and not multiprocessing.active_children():
            break
        time.sleep(0.1)
    return {"children": len(multiprocessing.active_children()), "threads": sorted(others)}


def main(work: Path) -> None:
    target = write_target(work / "target")
    shards = [write_shard(work / f"shard{i}.safetensors", 12, seed=i) for i in range(2)]
    vocab = build_draft_vocab(shards, V, 48)
    cfg = TrainConfig(
        epochs=100,
        max_steps=4,
        batch_packs=1,
        max_tokens=64,
        save_every=4,
        eval_every=0,
        num_workers=1,
        device="cpu",
    )
    report = {}
    trainer.train(shards, target, vocab, work / "finished", cfg, TINY_DRAFT)
    report["finished"] = left_behind()
    with mock.patch.object(trainer, "train_step", side_effect=RuntimeError("a step failed")):
        try:
            trainer.train(shards, target, vocab, work / "raised", cfg, TINY_DRAFT)
        except RuntimeError as e:
            report["raised_with"] = str(e)
    report["raised"] = left_behind()
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
