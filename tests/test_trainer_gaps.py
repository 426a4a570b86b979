"""The trainer's edge cases of issue 35, each red on 645dcbc (the code before the fixes):
a lost best/ is rebuilt; a changed recipe leaves no checkpoint of the old run; noise resumes
exactly and draws from no global generator; the loss is per token over the whole global
batch (padding packs weigh nothing) and validation reports the training objective and the
KL apart; warm-up stays where the first total put it when the run is extended.
(The sixth, streaming's checks, is in tests/test_stream.py.)

Tiny synthetic target and shards (tests/support/draft_fixtures.py), one CPU process."""

import csv
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagleflow.draft.vocab import build_draft_vocab
from eagleflow.draft.weights import build_draft, load_trained
from eagleflow.plan.settings import TrainConfig
from eagleflow.target.head import TargetHead
from eagleflow.train import checkpoint
from eagleflow.train.data import PackDataset, read_layout, sample_table
from eagleflow.train.objective import figures
from eagleflow.train.optimizer import lr_factor
from eagleflow.train.parallel import Parallelism, all_reduce
from eagleflow.train.step import StepContext, train_step
from eagleflow.train.trainer import train
from support.draft_fixtures import TINY_DRAFT, L, V, write_shard, write_target

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny(tmp_path):
    target = write_target(tmp_path / "target")
    shards = [write_shard(tmp_path / f"shard{i}.safetensors", 12, seed=i) for i in range(2)]
    return target, shards, build_draft_vocab(shards, V, 48)


def config(steps: int, **kw) -> TrainConfig:
    """`steps` steps of one pack each, a checkpoint every 4, validated at the end only;
    1 in 4 samples held out (the tiny shards then hold some)."""
    base = TrainConfig(
        epochs=100,
        max_steps=steps,
        batch_packs=1,
        ttt_steps=3,
        lr=3e-3,
        warmup_ratio=0.25,
        min_lr_ratio=0.1,
        weight_decay=0.0,
        grad_clip=1.0,
        max_tokens=64,
        save_every=4,
        eval_every=0,
        # no loader worker: a fork from this test process, which earlier tests leave with
        # threads (gloo's among them), can deadlock in the child
        num_workers=0,
        device="cpu",
        heldout_modulus=4,
    )
    return replace(base, **kw)


def run(tiny, out, cfg, stop_after=None):
    target, shards, vocab = tiny
    return train(shards, target, vocab, out, cfg, TINY_DRAFT, stop_after=stop_after)


def same_weights(a, b):
    for name, x in a.state_dict().items():
        assert torch.equal(x, b.state_dict()[name]), name


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- 1. a lost best/


def test_a_finished_run_that_lost_its_best_draft_writes_it_again(tiny, tmp_path):
    out = tmp_path / "run"
    first = run(tiny, out, config(8))
    assert first["heldout_samples"] > 0 and first["best_step"] == 8
    kept = tmp_path / "best-before"
    shutil.copytree(out / checkpoint.BEST, kept)
    shutil.rmtree(out / checkpoint.BEST)
    again = run(tiny, out, config(8))
    assert again["start_step"] == 8
    assert (out / checkpoint.BEST / checkpoint.BEST_WEIGHTS).exists(), "best/ not rebuilt"
    same_weights(load_trained(kept)[0], load_trained(out)[0])


# ---------------------------------------------------------------- 2. a changed recipe


def test_a_changed_recipe_leaves_no_checkpoint_of_the_old_run(tiny, tmp_path):
    """Seed 0 ran to step 10 (checkpoints 8 and 10); the seed-1 rerun is killed after step 9:
    every checkpoint left is seed 1's, the next rerun resumes from its step 8, and ends with
    the draft of an uninterrupted seed-1 run."""
    out = tmp_path / "run"
    run(tiny, out, config(10))
    run(tiny, out, config(10, seed=1), stop_after=9)
    left = checkpoint.finished(out)
    assert left, "no checkpoint of the seed-1 run"
    for path in left:
        seed = checkpoint.read_recipe(path)["train_config"]["seed"]
        assert seed == 1, f"{path.name} is the old run's (seed {seed})"
    assert json.loads((out / "progress.json").read_text())["step"] == 8
    again = run(tiny, out, config(10, seed=1))
    assert again["start_step"] == 8
    run(tiny, tmp_path / "straight", config(10, seed=1))
    same_weights(load_trained(tmp_path / "straight")[0], load_trained(out)[0])


# ---------------------------------------------------------------- 3. noise


def test_noise_resumes_exactly_and_draws_from_no_global_generator(tiny, tmp_path):
    cfg = config(10, noise_std=0.5)
    run(tiny, tmp_path / "straight", cfg)
    assert run(tiny, tmp_path / "killed", cfg, stop_after=7)["end_step"] == 7
    assert run(tiny, tmp_path / "killed", cfg)["start_step"] == 4
    same_weights(load_trained(tmp_path / "straight")[0], load_trained(tmp_path / "killed")[0])
    loss = [r["loss"] for r in rows(tmp_path / "straight" / "metrics.csv")]
    assert loss == [r["loss"] for r in rows(tmp_path / "killed" / "metrics.csv")]
    # the noise is there (another run without it trains other weights) ...
    run(tiny, tmp_path / "clean", config(10))
    clean = load_trained(tmp_path / "clean")[0]
    assert not torch.equal(clean.fc.weight, load_trained(tmp_path / "straight")[0].fc.weight)
    # ... and comes from no global generator: the CPU's state is untouched by a noisy step
    model, head, dataset = parts(tiny)
    before = torch.get_rng_state()
    step(model, head, cfg, [dataset[pack_of(dataset, 0)]], 1)
    assert torch.equal(before, torch.get_rng_state()), "noise drew from the CPU generator"


# ---------------------------------------------------------------- 4. the loss per token


def parts(tiny):
    target, shards, vocab = tiny
    model = build_draft(target, vocab, 3, 0, **TINY_DRAFT)
    head = TargetHead.load(target, vocab.target_ids, dtype=torch.bfloat16)
    layout = read_layout(shards, L)
    return model, head, PackDataset(layout, sample_table(layout.paths), 3)


def pack_of(dataset, shard: int, n: int = 3) -> tuple:
    """The first `n` samples of a shard (samples of 6 to 13 tokens: packs of unequal size)."""
    table = dataset.table
    return tuple(int(i) for i in range(len(table.shard)) if table.shard[i] == shard)[:n]


def step(model, head, cfg, batches, micro_steps):
    """(the step's logged loss, the gradient) of one optimizer step over `batches` from the
    model's current weights (SGD at lr 1, no clipping: the update is the gradient)."""
    model = _copy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    sgd = torch.optim.SGD(params, lr=1.0)
    cfg = replace(cfg, grad_clip=0.0)
    assert len(batches) == micro_steps
    ctx = StepContext(cfg, Parallelism(0, 1, torch.device("cpu")))
    result = train_step(model, head, [sgd], batches, ctx)
    loss = figures(all_reduce(result.sums), cfg.step_weight)["loss"]
    return loss, [b - p.detach() for b, p in zip(before, params)]


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_a_global_batch_weighs_every_token_once_and_padding_packs_nothing(tiny):
    model, head, dataset = parts(tiny)
    cfg = config(1)
    a, b = pack_of(dataset, 0, 2), pack_of(dataset, 1, 4)
    assert int(dataset[a].step_tokens[0]) != int(dataset[b].step_tokens[0])
    # two packs in one step train as one pack holding both (attention stays within a sample)
    loss_two, grad_two = step(model, head, cfg, [dataset[a], dataset[b]], 2)
    loss_one, grad_one = step(model, head, cfg, [dataset[a + b]], 1)
    assert loss_two == pytest.approx(loss_one, rel=1e-4)
    for x, y in zip(grad_two, grad_one):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-6)
    # a padding pack at an epoch's end changes neither the loss nor the gradient
    loss_pad, grad_pad = step(model, head, cfg, [dataset[a], dataset[()]], 2)
    loss_a, grad_a = step(model, head, cfg, [dataset[a]], 1)
    assert loss_pad == pytest.approx(loss_a, rel=1e-5)
    for x, y in zip(grad_pad, grad_a):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)


def test_validation_reports_the_training_objective_and_the_kl_apart(tiny, tmp_path):
    for loss in ("kl", "lk_hybrid"):
        run(tiny, tmp_path / loss, config(4, loss=loss))
        (row,) = rows(tmp_path / loss / "validation.csv")
        assert "kl" in row, "validation.csv has no KL column"
        if loss == "kl":
            assert row["loss"] == row["kl"]
        else:  # w KL + (1 - w) TV, w <= 1 and TV <= 1: not the KL
            assert float(row["loss"]) != float(row["kl"])


# ---------------------------------------------------------------- 5. warm-up


def test_extending_a_run_keeps_the_warm_up_of_its_first_total(tiny, tmp_path):
    """4 steps at warmup_ratio 0.25: 1 warm-up step. Extended to 40 steps, the resumed step 5
    is on the cosine of the new total, not back in a warm-up of 10 steps."""
    out = tmp_path / "run"
    run(tiny, out, config(4))
    again = run(tiny, out, config(40))
    assert again["start_step"] == 4
    lr = [r["lr"] for r in rows(out / "metrics.csv")]
    cfg = config(40)
    assert lr[4] == f"{cfg.lr * lr_factor(4, 40, 1, cfg.min_lr_ratio):.3e}", lr[:6]


@pytest.mark.slow
def test_a_run_leaves_no_loader_worker_or_watchdog_thread(tmp_path):
    """A run ends its loader's workers and its stall watchdog's thread when it returns, and
    when a step raises: a trainer in a long-lived process (a notebook, these tests) keeps
    neither, and a later fork copies no running thread. In a fresh process
    (tests/support/trainer_leftovers.py)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "workflow"), str(REPO / "tests")])
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "trainer_leftovers.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["raised_with"] == "a step failed", report
    nothing = {"children": 0, "threads": []}
    assert report["finished"] == nothing and report["raised"] == nothing, report
