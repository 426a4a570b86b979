"""The trainer's command line: one process, or every rank under torchrun
(`torchrun --nproc_per_node N -m eagleflow.train.cli ...`) or srun (`eagleflow.train.rank`).
`eagleflow.plan.launch` builds these commands."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

from eagleflow.draft.vocab import load_vocab
from eagleflow.plan.settings import TrainConfig
from eagleflow.train.states import StreamSource
from eagleflow.train.trainer import train


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train an EAGLE-3 draft on extracted shards.")
    p.add_argument("--shards", nargs="+", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--vocab", required=True, help="vocab.safetensors from draft_vocab")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="{}", help="TrainConfig fields: JSON, or a JSON file")
    p.add_argument("--draft", default="{}", help="DraftConfig overrides as JSON")
    p.add_argument(
        "--stop-after", type=int, default=None, help="end after this step, as a crash would"
    )
    p.add_argument(
        "--stream",
        default=None,
        help="a StreamSource JSON file: states from the capture server (--shards: token shards)",
    )
    return p


def main(argv=None) -> None:
    a = parser().parse_args(argv)
    config = a.config if a.config.lstrip().startswith("{") else Path(a.config).read_text()
    summary = train(
        a.shards,
        a.target,
        load_vocab(a.vocab),
        a.out,
        TrainConfig(**json.loads(config)),
        json.loads(a.draft),
        stop_after=a.stop_after,
        stream=StreamSource.load(a.stream) if a.stream else None,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
