"""The draft trainer at several world sizes (torchrun, gloo on CPU): the same global batch
gives the same step at 1 and 2 ranks, checkpoints resume across world sizes and extended
runs, a killed rank fails the job by name and the rerun resumes; its data plan (packing
across shards, per-epoch shuffles, exact positions) and samples longer than a pack.

Tiny target and shards (`support.draft_fixtures`): each test takes seconds.
"""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagleflow.data.heldout import excluder
from eagleflow.draft.vocab import build_draft_vocab, save_vocab
from eagleflow.draft.weights import load_trained
from eagleflow.plan.settings import TrainConfig, check_world
from eagleflow.store.quant import FP8
from eagleflow.train.data import PackPlan, RankSampler, read_layout, sample_table
from eagleflow.train.trainer import train
from support import split_pack
from support.draft_fixtures import TINY_DRAFT, TINY_MLA_DRAFT, L, V, write_shard, write_target

REPO = Path(__file__).resolve().parents[1]
# Each test takes seconds to a minute; a hung rank fails its test long before the suite's limit.
pytestmark = pytest.mark.timeout(300)
# 2 x 12 samples of 6-13 tokens in packs of 64: 4 packs an epoch, 2 steps of 2 packs
CONFIG = dict(
    epochs=3,
    batch_packs=2,
    max_tokens=64,
    lr=3e-3,
    warmup_ratio=0.1,
    save_every=2,
    eval_every=2,
    num_workers=1,
    device="cpu",
)


@pytest.fixture
def data(tmp_path):
    target = write_target(tmp_path / "target")
    shards = [write_shard(tmp_path / f"shard{i}.safetensors", 12, seed=i) for i in range(2)]
    vocab = build_draft_vocab(shards, V, 48)
    save_vocab(vocab, tmp_path / "vocab.safetensors")
    return target, shards, vocab


def run_here(data, out, stop_after=None, draft=TINY_DRAFT, **changes):
    """One rank, in this process (no process group: the plain model)."""
    target, shards, vocab = data
    cfg = TrainConfig(**{**CONFIG, **changes})
    return train(shards, target, vocab, out, cfg, draft, stop_after=stop_after)


def torchrun_command(data, out, nproc, stop_after=None, draft=TINY_DRAFT, **changes):
    """`torchrun --nproc_per_node N -m eagleflow.train.cli ...`; N = 0: the CLI alone."""
    target, shards, _ = data
    cmd = [sys.executable, "-m", "eagleflow.train.cli"]
    if nproc:
        cmd[2:2] = ["torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m"]
    cmd += ["--shards", *map(str, shards), "--target", str(target)]
    cmd += ["--vocab", str(Path(target).parent / "vocab.safetensors"), "--out", str(out)]
    cmd += ["--config", json.dumps({**CONFIG, **changes}), "--draft", json.dumps(draft)]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    return cmd


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "workflow"))


def torchrun(data, out, nproc, stop_after=None, draft=TINY_DRAFT, **changes):
    proc = subprocess.run(
        torchrun_command(data, out, nproc, stop_after, draft, **changes),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def losses(out) -> list[float]:
    with open(Path(out) / "metrics.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def assert_same_draft(a, b, atol=1e-5):
    (x, _), (y, _) = load_trained(a), load_trained(b)
    for (name, p), (_, q) in zip(x.state_dict().items(), y.state_dict().items()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- distributed runs


@pytest.mark.slow
def test_two_ranks_take_the_steps_of_one_rank_with_the_same_global_batch(data, tmp_path):
    """2 ranks x 1 pack (FSDP on gloo) against 1 rank accumulating 2 packs."""
    one = run_here(data, tmp_path / "one")
    proc = torchrun(data, tmp_path / "two", 2)
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["world_size"] == 1 and one["micro_steps_per_rank"] == 2
    assert two["world_size"] == 2 and two["micro_steps_per_rank"] == 1
    assert two["parallelism"] == "fsdp (gloo)", two["parallelism"]
    assert len(losses(tmp_path / "one")) == one["steps"] == 6
    torch.testing.assert_close(
        losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5, atol=0
    )
    for key in ("tokens_trained", "samples_trained", "best_step"):
        assert one[key] == two[key], key
    al_one, al_two = one["simulated_acceptance_length"], two["simulated_acceptance_length"]
    assert al_one["total"] == pytest.approx(al_two["total"]) and al_one["total"] >= 1
    assert al_one["per_position"] == pytest.approx(al_two["per_position"])
    assert_same_draft(tmp_path / "one", tmp_path / "two")
    # no frozen tensor in the checkpoint, in bf16 nowhere: only what the optimizer trains
    ckpt = sorted((tmp_path / "two" / "checkpoints").iterdir())[-1]  # the latest of two
    assert ckpt.name == "step-00000006" and (ckpt / ".metadata").exists()
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    draft, _ = load_trained(tmp_path / "two")
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert {k.removeprefix("train.model.") for k in keys if k.startswith("train.model.")} == (
        trained | {"d2t", "t2d"}
    )
    assert {k.split(".")[3] for k in keys if k.startswith("train.optim.state.")} <= {"fc"} | {
        n.split(".")[0] for n in trained
    }
    assert not any("embed_tokens" in k for k in keys)
    assert "step 6" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention,checkpointing,decoder",
    [("flex", "0", "llama"), ("flex", "1", "llama"), ("eager", "0", "llama"), ("flex", "1", "mla")],
)
def test_a_pack_split_over_two_ranks_gives_the_whole_packs_loss_and_gradients(
    tmp_path, attention, checkpointing, decoder
):
    """Sequence splitting (gloo): each rank trains half of a 600-token pack (slices of 256
    anchors, the last padded), gathering the step-0 keys; the slices' losses, logits and
    gradients add up to the whole pack's in one process (float64; with activation
    checkpointing the gather runs again in backward). The Llama draft, and the MLA draft
    (its per-head k and v of other widths gathered)."""
    out = tmp_path / "split.pt"
    script = REPO / "tests" / "support" / "split_pack.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    cmd += ["2", str(script), str(out), attention, checkpointing, decoder]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    split = torch.load(out)
    loss, logits, grads = split_pack.pack_loss(attention, checkpointing == "1", decoder=decoder)
    torch.testing.assert_close(split["loss"], loss, rtol=1e-10, atol=0)
    for a, b in zip(split["logits"], logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert split["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(split["grads"][name], grad, rtol=1e-8, atol=1e-11, msg=name)


@pytest.mark.slow
def test_two_ranks_train_the_mla_draft_as_one_rank(data, tmp_path):
    """The MLA draft under FSDP (2 ranks x 1 pack, gloo) takes the steps of one rank
    accumulating 2 packs: the same losses and the same draft."""
    one = run_here(data, tmp_path / "one", draft=TINY_MLA_DRAFT)
    torchrun(data, tmp_path / "two", 2, draft=TINY_MLA_DRAFT)
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["parallelism"] == "fsdp (gloo)"
    assert len(losses(tmp_path / "one")) == one["steps"] == 6
    torch.testing.assert_close(
        losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5, atol=0
    )
    assert_same_draft(tmp_path / "one", tmp_path / "two")
    assert load_trained(tmp_path / "two")[0].cfg.decoder == "mla"


@pytest.mark.slow
def test_two_ranks_sharing_each_pack_take_the_steps_of_one_rank(tmp_path):
    """draft.sequence_parallel: 2 on 2 ranks: every pack split in two slices of 256 anchors
    (each rank reads only its slice's rows and scales of fp8 shards); the same packs, losses and
    draft as one rank training each pack whole."""
    target = write_target(tmp_path / "target")
    lengths = [150, 40, 90, 210, 12, 60, 33, 100, 9, 70, 130, 25]
    shards = [
        write_shard(tmp_path / "s.safetensors", 0, 3, lengths=lengths, storage_dtype=FP8),
        write_shard(tmp_path / "t.safetensors", 0, 4, lengths=lengths[::-1], storage_dtype=FP8),
    ]
    vocab = build_draft_vocab(shards, V, 48)
    save_vocab(vocab, tmp_path / "vocab.safetensors")
    data = (target, shards, vocab)
    changes = dict(max_tokens=320, epochs=2)
    one = run_here(data, tmp_path / "one", **changes)
    torchrun(data, tmp_path / "split", 2, sequence_parallel=2, **changes)
    split = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert split["world_size"] == 2 and split["sequence_parallel"] == 2
    assert split["micro_steps_per_rank"] == one["micro_steps_per_rank"] == 2
    assert split["parallelism"] == "fsdp (gloo), sequence parallel over 2 ranks"
    torch.testing.assert_close(
        losses(tmp_path / "split"), losses(tmp_path / "one"), rtol=1e-5, atol=0
    )
    for key in ("tokens_trained", "samples_trained", "best_step", "steps"):
        assert one[key] == split[key], key
    al_one, al_split = one["simulated_acceptance_length"], split["simulated_acceptance_length"]
    assert al_one["per_position"] == pytest.approx(al_split["per_position"])
    assert_same_draft(tmp_path / "one", tmp_path / "split")


@pytest.mark.slow
def test_a_frozen_target_lm_head_trains_alike_on_one_and_two_ranks_and_stays_the_targets(
    data, tmp_path
):
    """draft.lm_head: target_frozen (speculators' draft): the target's rows, outside FSDP's
    sharding and the optimizer, in the exported weights unchanged."""
    from eagleflow.target.head import LM_HEAD, read_target_tensor

    target, _, vocab = data
    one = run_here(data, tmp_path / "one", lm_head="target_frozen")
    torchrun(data, tmp_path / "two", 2, lm_head="target_frozen")
    torch.testing.assert_close(
        losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5, atol=0
    )
    assert_same_draft(tmp_path / "one", tmp_path / "two")
    rows = read_target_tensor(target, LM_HEAD)[vocab.target_ids]
    draft, _ = load_trained(tmp_path / "two")
    assert torch.equal(draft.lm_head.weight, rows.float())
    assert one["steps"] == 6


@pytest.mark.slow
def test_muon_orthogonalizes_whole_matrices_on_two_ranks_as_on_one(data, tmp_path):
    """draft.optimizer: muon. Under FSDP each rank holds rows of a matrix; Muon's update is the
    whole matrix's (DTensor ops), so two ranks take one rank's steps. AdamW takes others."""
    from eagleflow.train.optimizer import build_optimizers, muon_split

    run_here(data, tmp_path / "adamw")
    draft, _ = load_trained(tmp_path / "adamw")
    muon, adamw = muon_split(draft)
    names = {id(p): n for n, p in draft.named_parameters()}
    assert {names[id(p)].split(".")[-2] for p in muon} >= {"fc", "q_proj", "down_proj"}
    assert all(p.ndim == 2 for p in muon)
    assert "lm_head.weight" in {names[id(p)] for p in adamw}
    cfg = TrainConfig(**{**CONFIG, "optimizer": "muon", "muon_lr": 0.02})
    optims = build_optimizers(draft, cfg)
    assert [type(o).__name__ for o in optims] == ["Muon", "AdamW"]
    assert optims[0].param_groups[0]["peak_lr"] == 0.02

    # the ranks' gradient sums round otherwise than one process's
    one = run_here(data, tmp_path / "one", optimizer="muon", muon_lr=0.02)
    torchrun(data, tmp_path / "two", 2, optimizer="muon", muon_lr=0.02)
    torch.testing.assert_close(
        losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-4, atol=0
    )
    # Weights after 6 steps: within a few bf16 steps of Newton-Schulz rounding (largest seen
    # 1.75e-3 on o_proj's ~7e-2 entries since the objective is per token over the global
    # batch, whose sums the ranks add in another order).
    assert_same_draft(tmp_path / "one", tmp_path / "two", atol=2.5e-3)
    assert losses(tmp_path / "one")[1:] != losses(tmp_path / "adamw")[1:]
    assert one["steps"] == 6
    with pytest.raises(ValueError, match="draft.optimizer = 'sgd'"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="draft.muon_lr = 0: must be above 0"):
        TrainConfig(muon_lr=0)


MUON_STEP = """
import torch, torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
from eagleflow.train.optimizer import Muon
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
weight, grad = torch.randn(32, 96), torch.randn(32, 96)
def step(w, g):
    w = torch.nn.Parameter(w)
    w.grad = g
    Muon([w], lr=0.1, weight_decay=0.0).step()
    return w.detach()
full = step(weight.clone(), grad.clone())
sharded = step(*(distribute_tensor(t, mesh, [Shard(0)]) for t in (weight, grad))).full_tensor()
rows = slice(16 * dist.get_rank(), 16 * dist.get_rank() + 16)
own_rows = step(weight[rows].clone(), grad[rows].clone())  # what orthogonalizing a shard gives
whole, own = (sharded - full).abs().max(), (own_rows - full[rows]).abs().max()
if dist.get_rank() == 0:
    print(f"whole={whole:.3e} own_rows={own:.3e}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_muon_on_a_row_sharded_matrix_steps_the_whole_matrix(tmp_path):
    """FSDP2 shards a weight by rows (DTensor Shard(0)); the trainer's Muon (torch's step) on
    that DTensor updates it as the whole matrix, not as each rank's rows orthogonalized
    alone."""
    script = tmp_path / "muon_step.py"
    script.write_text(MUON_STEP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    proc = subprocess.run(
        [*cmd, "2", str(script)], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"whole=(\S+) own_rows=(\S+)", proc.stdout)
    whole, own_rows = float(found[1]), float(found[2])
    assert whole < 2e-3 and own_rows > 1e-2, proc.stdout


def test_sequence_parallel_must_divide_the_ranks(data, tmp_path):
    with pytest.raises(ValueError, match=r"draft.sequence_parallel = 2 .* the 1 ranks"):
        run_here(data, tmp_path / "out", sequence_parallel=2)


@pytest.mark.slow
def test_a_checkpoint_resumes_across_world_sizes(data, tmp_path):
    """1 rank -> 2 ranks -> 1 rank, each run stopped as a crash would: the same draft as an
    uninterrupted run."""
    run_here(data, tmp_path / "straight")
    out = tmp_path / "moved"
    assert run_here(data, out, stop_after=3)["end_step"] == 3  # checkpoint at step 2
    proc = torchrun(data, out, 2, stop_after=5)  # resumes at 2, checkpoint at 4
    assert "resuming from" in proc.stdout and "(step 2 of 6)" in proc.stdout, proc.stdout
    proc = torchrun(data, out, 0)  # the CLI alone, one process: resumes at 4
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["world_size"] == 1 and last["parallelism"] == "single process"
    assert last["start_step"] == 4 and last["end_step"] == 6
    assert len(losses(out)) == 6
    torch.testing.assert_close(losses(out), losses(tmp_path / "straight"), rtol=1e-5, atol=0)
    assert_same_draft(tmp_path / "straight", out)
    kept = sorted(d.name for d in (out / "checkpoints").iterdir())  # the last two
    assert kept == ["step-00000004", "step-00000006"]


def test_more_epochs_resume_the_run_and_a_changed_recipe_restarts_it(data, tmp_path, capsys):
    out = tmp_path / "run"
    first = run_here(data, out, epochs=1)
    assert (first["start_step"], first["end_step"]) == (0, 2)
    second = run_here(data, out, epochs=2)
    assert (second["start_step"], second["end_step"]) == (2, 4)
    # every training sample once per epoch
    assert second["samples_trained"] == 2 * first["samples_trained"] == 2 * first["train_samples"]
    assert second["tokens_trained"] == 2 * first["tokens_trained"]
    assert "resuming from" in capsys.readouterr().out
    again = run_here(data, out, epochs=2, lr=1e-3)
    assert again["start_step"] == 0
    assert "train_config.lr changed" in capsys.readouterr().out


@pytest.mark.slow
def test_sigkill_of_one_rank_fails_the_job_by_rank_and_the_rerun_resumes(data, tmp_path):
    out = tmp_path / "run"
    cmd = torchrun_command(data, out, 2, epochs=40)  # 80 steps
    # output to files: a full pipe nobody reads would stall the ranks
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout, "w") as o, open(stderr, "w") as e:
        proc = subprocess.Popen(cmd, env=ENV, stdout=o, stderr=e, text=True)
    try:
        deadline = time.time() + 120
        while not any((out / "checkpoints").glob("step-*[0-9]")):
            if proc.poll() is not None or time.time() > deadline:
                kill_tree(proc.pid)
                proc.wait(timeout=60)
                raise AssertionError(
                    f"no checkpoint in 120 s (torchrun exit {proc.returncode}):\n"
                    + stdout.read_text()[-3000:]
                    + stderr.read_text()[-6000:]
                )
            time.sleep(0.1)
        victim = rank_pid(proc.pid, 1)
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc.pid)
    err = stderr.read_text()
    assert proc.returncode != 0
    assert re.search(r"Root Cause.*rank\s*: 1 \(local_rank: 1\)", err, re.S), err[-3000:]
    assert "Signal 9 (SIGKILL)" in err, err[-3000:]
    done = sorted(d.name for d in (out / "checkpoints").iterdir() if d.name[-1].isdigit())
    assert 1 <= len(done) <= 2  # the last two are kept
    rerun = torchrun(data, out, 2, epochs=40)
    summary = json.loads((out / "summary.json").read_text())
    assert f"resuming from {out / 'checkpoints' / done[-1]}" in rerun.stdout
    assert summary["start_step"] == int(done[-1].split("-")[1]) > 0 and summary["end_step"] == 80
    assert len(losses(out)) == 80


@pytest.mark.slow
def test_a_stalled_data_worker_fails_the_rank_by_name_with_every_stack(tmp_path):
    """draft.stall_timeout: the training loader's worker sleeps forever from its 5th pack (step
    3, after the checkpoint of step 2); the watchdog fails the rank within the limit, naming it
    and what it waited for, with every thread's stack, and leaves no worker behind (the
    captured output would stay open)."""
    script = REPO / "tests" / "support" / "stalling_trainer.py"
    env = dict(ENV, PYTHONPATH=f"{REPO / 'workflow'}:{REPO / 'tests'}")
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "5", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took, err = time.time() - t0, proc.stderr
    assert proc.returncode == 1, proc.stdout[-2000:] + err[-4000:]
    assert "finished without a stall" not in proc.stdout
    named = (
        r"rank 0 \(pid \d+\) stalled: it waited \d+ s for the training loader's next pack, "
        r"beyond draft.stall_timeout = 3 s"
    )
    assert re.search(named, err), err[-4000:]
    assert "Thread 0x" in err and "(most recent call first)" in err, err[-4000:]
    assert "in fetch" in err, err[-4000:]  # the main thread, where it waited
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()  # the rerun resumes
    assert took < 60, took


def test_the_stall_limit_grows_with_the_slowest_step_above_its_floor():
    from eagleflow.train.watchdog import STALL_FLOOR_S, STALL_STEP_FACTOR, Watchdog

    auto, fixed = Watchdog(0), Watchdog(0, timeout_s=5)
    try:
        assert auto.limit_s == STALL_FLOOR_S and fixed.limit_s == 5
        auto.step_took(1.0)
        assert auto.limit_s == STALL_FLOOR_S
        auto.step_took(STALL_FLOOR_S / STALL_STEP_FACTOR * 2)
        assert auto.limit_s == 2 * STALL_FLOOR_S
        fixed.step_took(100.0)
        assert fixed.limit_s == 5
        with auto.waiting("a step"):
            with auto.waiting("the next pack"):
                assert auto._current[0] == "the next pack"
            assert auto._current[0] == "a step"  # the enclosing wait again
        assert auto._current is None
    finally:
        auto.close()
        fixed.close()
    with pytest.raises(ValueError, match="draft.stall_timeout = -1"):
        TrainConfig(stall_timeout=-1)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it (torchrun's ranks and their data workers)."""
    for child in children(pid):
        kill_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def children(pid: int) -> list[int]:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def rank_pid(agent: int, rank: int) -> int:
    """The pid of torchrun's worker process for `rank` (a child of the agent)."""
    pids = children(agent)
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} among {pids}")


# ---------------------------------------------------------------- long samples


def test_a_sample_three_times_max_tokens_is_trained_in_full(tmp_path, capsys):
    target = write_target(tmp_path / "target")
    lengths = [10, 192, 12, 30, 8, 40, 20, 9]  # 192 = 3 x max_tokens
    shards = [write_shard(tmp_path / "s.safetensors", 0, seed=3, lengths=lengths)]
    shards.append(write_shard(tmp_path / "t.safetensors", 10, seed=4))
    vocab = build_draft_vocab(shards, V, 48)
    table = sample_table(read_layout(shards, L).paths, excluder())
    long = 1
    assert long in table.train.tolist() and table.length[long] == 192
    # the loss-masked tokens every training sample trains: all but each sample's first
    expected = 0
    for i in table.train.tolist():
        from safetensors import safe_open

        with safe_open(str(shards[table.shard[i]]), framework="pt") as f:
            a = int(table.start[i])
            expected += int(f.get_slice("loss_mask")[a + 1 : a + int(table.length[i])].sum())
    cfg = dict(CONFIG, epochs=1, batch_packs=1)
    summary = train(shards, target, vocab, tmp_path / "run", TrainConfig(**cfg), TINY_DRAFT)
    assert summary["samples_cut"] == 0 and summary["samples_cut_names"] == []
    assert summary["samples_trained"] == len(table.train)
    assert summary["tokens_trained"] == expected
    assert summary["longest_sample_tokens"] == 192
    plan = PackPlan(table, 64, 1, seed=0)
    assert (long,) in [plan.pack(0, p) for p in range(plan.num_packs(0))]  # a pack of its own
    # a hard limit below it: not trained, counted and named, never cut
    cfg["max_sample_tokens"] = 100
    capsys.readouterr()
    summary = train(shards, target, vocab, tmp_path / "limited", TrainConfig(**cfg), TINY_DRAFT)
    assert summary["samples_cut"] == 1
    assert summary["samples_cut_names"] == [
        {"shard": "s.safetensors", "sample_id": "s3-1", "tokens": 192}
    ]
    assert "sample s3-1 of s.safetensors: 192 tokens" in capsys.readouterr().out
    assert summary["samples_trained"] == len(table.train) - 1


# ---------------------------------------------------------------- the data plan


def test_plan_is_deterministic_per_seed_and_epoch_and_covers_each_sample_once(tmp_path):
    shards = [write_shard(tmp_path / f"s{i}.safetensors", 30, seed=i) for i in range(3)]
    table = sample_table(shards, excluder())
    assert 0 < len(table.heldout) and len(table.train) + len(table.heldout) == 90
    plan = PackPlan(table, 64, 4, seed=7)

    def packs(p, e):
        return [p.pack(e, i) for i in range(p.num_packs(e))]

    for e in range(3):
        epoch = packs(plan, e)
        flat = [i for pack in epoch for i in pack]
        assert sorted(flat) == sorted(table.train.tolist())  # each training sample once
        assert all(sum(table.length[list(pack)]) <= 64 for pack in epoch)
        assert packs(PackPlan(table, 64, 4, seed=7), e) == epoch  # a pure function
    assert packs(plan, 0) != packs(plan, 1)  # reshuffled each epoch
    assert packs(PackPlan(table, 64, 4, seed=8), 0) != packs(plan, 0)
    assert any(len({int(table.shard[i]) for i in p}) > 1 for p in packs(plan, 0))  # across shards
    fill = table.length[table.train].sum() / (plan.num_packs(0) * 64)
    assert fill > 0.9, fill

    # global batches are the same at any world size; a sampler resumes at any step
    starts = plan.epoch_starts(3)
    total = starts[-1]
    assert total == sum(-(-plan.num_packs(e) // 4) for e in range(3))

    def global_batches(world, start=0):
        ranks = [list(RankSampler(plan, starts, start, total, r, world)) for r in range(world)]
        m = 4 // world
        return [
            sorted(p for r in range(world) for p in ranks[r][s * m : (s + 1) * m] if p)
            for s in range(total - start)
        ]

    one = global_batches(1)
    assert global_batches(2) == one and global_batches(4) == one
    assert global_batches(2, start=5) == one[5:]
    # the rule the sampler relies on, checked once for the workflow and the trainer
    with pytest.raises(ValueError, match="batch_packs = 4 .* multiple of 3"):
        check_world(3, 4, 1)
