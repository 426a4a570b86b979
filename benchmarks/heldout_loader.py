"""What reading the held-out packs in the rank costs, against the persistent held-out workers
it replaced (issue 41: a worker forked once threads run can deadlock).

Two arms, alternated `--repeats` times on the same data, one rank in this process at the
embedded default's draft recipe (config/config.yaml: packs of 256 tokens, 2 per step, one
training worker, every held-out sample validated every `--eval-every` steps):

  in_rank     the trainer as it is: the held-out loader has no workers
  persistent  the held-out loader with `num_workers` persistent workers (the code before the
              fix), put back by wrapping `eagleflow.train.data.data_loader`

Per run: `validation_seconds` (summary.json: every validation's time, the held-out reads and
forwards), the validations run, `data_wait_share` (the training loader's wait over step
time) and the run's seconds. The data: the embedded default's shape with random states
(benchmarks/train_throughput.py's `build_embedded`, cached under --workdir).

Usage (from the repository root):
  .venv/bin/python benchmarks/heldout_loader.py [--workdir DIR] [--repeats 3] [--steps 20] \
      [--eval-every 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "benchmarks"))

from torch.utils.data import DataLoader  # noqa: E402
from train_throughput import build_embedded  # noqa: E402

import eagleflow.train.data as train_data  # noqa: E402
from eagleflow.draft.vocab import load_vocab  # noqa: E402
from eagleflow.plan.settings import TrainConfig  # noqa: E402
from eagleflow.train.data import HeldoutSampler  # noqa: E402
from eagleflow.train.records import VALIDATION  # noqa: E402
from eagleflow.train.trainer import train  # noqa: E402

RECIPE = dict(
    max_tokens=256,
    batch_packs=2,
    lr=0.003,
    optimizer="muon",
    warmup_ratio=0.05,
    min_lr_ratio=0.1,
    eval_every=50,
    save_every=10**9,
    num_workers=1,
    eval_samples=0,
    device="cpu",
)


def persistent_heldout(data_loader):
    """`data_loader` as before the fix: the held-out loader's workers forked at the first
    validation and kept."""

    def build(dataset, sampler, num_workers, prefetch_factor, pin):
        if not isinstance(sampler, HeldoutSampler):
            return data_loader(dataset, sampler, num_workers, prefetch_factor, pin)
        return DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,
            num_workers=RECIPE["num_workers"],
            prefetch_factor=prefetch_factor,
            pin_memory=pin,
            persistent_workers=True,
        )

    return build


def run(arm: str, shards, target, vocab, out: Path, steps: int, eval_every: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resumed one
    original = train_data.data_loader
    if arm == "persistent":
        train_data.data_loader = persistent_heldout(original)
    try:
        cfg = TrainConfig(**{**RECIPE, "max_steps": steps, "eval_every": eval_every})
        summary = train(shards, target, load_vocab(vocab), out, cfg)
    finally:
        train_data.data_loader = original
    validations = len((out / VALIDATION).read_text().splitlines()) - 1
    return {
        "arm": arm,
        "validation_s": summary["validation_seconds"],
        "validations": validations,
        "heldout_samples": summary["eval_samples"],
        "data_wait_share": summary["data_wait_share"],
        "seconds": summary["seconds"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/eagleflow-heldout-loader"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    a = p.parse_args(argv)
    shards, target, vocab = build_embedded(a.workdir / "embedded")
    rows = []
    for r in range(a.repeats):
        for arm in ("in_rank", "persistent"):
            row = run(
                arm, shards, target, vocab, a.workdir / "runs" / f"{arm}-{r}", a.steps, a.eval_every
            )
            rows.append(row)
            print(
                " ".join(
                    f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                )
            )
    for arm in ("in_rank", "persistent"):
        mine = [x for x in rows if x["arm"] == arm]
        per = [x["validation_s"] / x["validations"] for x in mine]
        waits = [x["data_wait_share"] for x in mine]
        print(
            f"{arm}: validation {statistics.median(per):.3f} s each (median of {len(per)}; "
            f"{min(per):.3f}-{max(per):.3f}), data_wait_share median "
            f"{statistics.median(waits):.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
