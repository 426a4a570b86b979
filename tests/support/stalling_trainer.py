"""Train the tiny draft in this process with a data worker that sleeps forever from its
`stall_from`-th pack on (tests of the stall watchdog).

python stalling_trainer.py OUT_DIR STALL_FROM STALL_TIMEOUT_S
"""

import sys
import time
from pathlib import Path

from eagleflow.draft.vocab import build_draft_vocab
from eagleflow.plan.settings import TrainConfig
from eagleflow.train.data import PackDataset
from eagleflow.train.trainer import train
from support.draft_fixtures import TINY_DRAFT, V, write_shard, write_target

out, stall_from, stall_timeout = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
target = write_target(out / "target")
shards = [write_shard(out / f"shard{i}.safetensors", 12, seed=i) for i in range(2)]
vocab = build_draft_vocab(shards, V, 48)

read = PackDataset.__getitem__
calls = {"n": 0}


def stalling_read(self, pack):
    calls["n"] += 1  # counted in the worker (forked after this patch)
    if calls["n"] >= stall_from:
        time.sleep(10**6)
    return read(self, pack)


PackDataset.__getitem__ = stalling_read
cfg = TrainConfig(
    epochs=3,
    batch_packs=2,
    max_tokens=64,
    num_workers=1,
    device="cpu",
    eval_every=2,
    save_every=2,
    stall_timeout=stall_timeout,
)
train(shards, target, vocab, out / "run", cfg, TINY_DRAFT)
print("finished without a stall", flush=True)
