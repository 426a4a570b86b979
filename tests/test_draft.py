"""Draft vocabulary, EAGLE-3 draft model, TTT trainer, export, and loading in vLLM.

Unit tests run on a tiny synthetic target and synthetic shards (seconds); the `vllm` test
exports a draft for the real embedded target and starts vLLM with it.
"""

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagleflow.draft.model import DraftConfig, Eagle3Draft
from eagleflow.draft.vocab import (
    build_draft_vocab,
    coverage,
    load_vocab,
    save_vocab,
    vocab_from_counts,
)
from eagleflow.draft.weights import load_trained
from eagleflow.export.speculators_format import export_draft
from eagleflow.plan.settings import TrainConfig
from eagleflow.store.quant import FP8
from eagleflow.train.data import PackDataset, read_layout, sample_table
from eagleflow.train.trainer import train
from support.draft_fixtures import (
    SPECULATORS_NAMES,
    TINY_DRAFT,
    H,
    L,
    V,
    vllm_reference_drafts,
    write_shard,
    write_target,
)

REPO = Path(__file__).resolve().parents[1]


def first_pack(shards, steps=3):
    """The batch of every sample of shard 0, as one pack."""
    layout = read_layout(shards, L)
    table = sample_table(layout.paths)
    first = tuple(int(i) for i in range(len(table.shard)) if table.shard[i] == 0)
    return PackDataset(layout, table, steps)[first]


@pytest.fixture
def tiny(tmp_path):
    target = write_target(tmp_path / "target")
    shards = [write_shard(tmp_path / f"shard{i}.safetensors", 12, seed=i) for i in range(2)]
    return target, shards


# ---------------------------------------------------------------- vocabulary


def test_vocab_picks_most_frequent_and_maps_round_trip():
    counts = torch.tensor([0, 5, 1, 9, 0, 9, 2, 0])
    v = vocab_from_counts(counts, 3)
    assert v.target_ids.tolist() == [1, 3, 5]  # 9, 9, 5: the three most frequent, ascending
    assert v.d2t.tolist() == [1, 2, 3]  # vLLM: target_id = draft_idx + d2t[draft_idx]
    assert (torch.arange(3) + v.d2t).tolist() == v.t2d.nonzero().flatten().tolist()
    assert v.t2d.tolist() == [False, True, False, True, False, True, False, False]
    assert v.coverage == pytest.approx(23 / 26)
    # ties broken by the lower id, size capped at the target vocabulary, unseen ids fill up
    assert vocab_from_counts(torch.tensor([1, 1, 1]), 2).target_ids.tolist() == [0, 1]
    full = vocab_from_counts(counts, 100)
    assert full.size == 8 and full.coverage == 1.0 and full.d2t.abs().sum() == 0


def test_vocab_counts_only_loss_masked_tokens(tmp_path):
    p = tmp_path / "s.safetensors"
    save_file(
        {
            "input_ids": torch.tensor([7, 7, 7, 3, 3, 1]),
            "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.uint8),
            "hidden_states": torch.zeros(6, 1, 2),
            "offsets": torch.tensor([0, 6]),
        },
        str(p),
    )
    v = build_draft_vocab([p], 8, 2)
    assert v.target_ids.tolist() == [1, 3]  # 7 is frequent but never loss-masked
    assert v.coverage == 1.0 and v.masked_tokens == 3
    assert coverage(v, torch.tensor([0, 0, 0, 1, 0, 0, 0, 3])) == pytest.approx(0.25)
    save_vocab(v, tmp_path / "vocab.safetensors")
    back = load_vocab(tmp_path / "vocab.safetensors")
    assert torch.equal(back.d2t, v.d2t) and torch.equal(back.t2d, v.t2d) and back.coverage == 1.0


# ---------------------------------------------------------------- draft model


def small_draft(num_aux=3, dv=16):
    cfg = DraftConfig(
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=dv,
        num_aux=num_aux,
    )
    torch.manual_seed(0)
    return Eagle3Draft(cfg)


def test_draft_forward_shapes_and_frozen_embedding():
    m = small_draft()
    n, steps = 10, 3
    logits = m(
        torch.randn(n, 3 * H),
        torch.randint(0, V, (steps, n)),
        torch.arange(n) + 1,
        torch.tensor([0] * 6 + [1] * 4),
        steps,
    )
    assert len(logits) == steps and all(lg.shape == (n, 16) for lg in logits)
    assert m.layers[0].self_attn.q_proj.weight.shape == (4 * 8, 2 * H)  # reads cat(embed, hidden)
    assert m.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 2 * H)
    assert m.fc.weight.shape == (H, 3 * H)
    assert not m.embed_tokens.weight.requires_grad


def test_draft_attention_is_causal_within_a_sample():
    m = small_draft()
    n = 8
    aux, tokens = torch.randn(n, 3 * H), torch.randint(0, V, (2, n))
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    pos = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4])
    base = m(aux, tokens, pos, doc, 2)
    aux2 = aux.clone()
    aux2[2] += 1.0  # change anchor 2 (sample 0)
    moved = m(aux2, tokens, pos, doc, 2)
    for k in range(2):
        assert torch.allclose(base[k][:2], moved[k][:2])  # earlier anchors: unchanged
        assert not torch.allclose(base[k][2:4], moved[k][2:4])  # later anchors: changed
        assert torch.allclose(base[k][4:], moved[k][4:])  # the other sample: unchanged
    # step 0 of the second sample equals that sample run alone (no leak across samples)
    alone = m(aux[4:], tokens[:, 4:], pos[4:], doc[4:], 2)
    assert torch.allclose(alone[0], base[0][4:], atol=1e-5)


def test_batch_alignment_matches_speculators_shift(tiny):
    target, shards = tiny
    layout = read_layout(shards, L)
    assert layout.aux_ids == [1, 2, 3] and layout.final_id == L
    b = first_pack(shards)
    with safe_open(str(shards[0]), framework="pt") as f:
        ids, mask, offsets = (
            f.get_tensor("input_ids"),
            f.get_tensor("loss_mask"),
            f.get_tensor("offsets"),
        )
        hidden = f.get_tensor("hidden_states").float()
    end0 = int(offsets[1])
    t = 2  # an anchor inside sample 0
    aux, final = b.values()
    assert torch.equal(aux[t], hidden[t, :3].flatten()) and torch.equal(final[t], hidden[t, 3])
    for k in range(3):
        assert b.tokens[k, t] == ids[t + 1 + k]
        assert b.target_index[k, t] == t + 1 + k
        assert bool(b.valid[k, t]) == bool(mask[t + 1 + k])
    assert not b.valid[:, end0 - 1].any()  # the last token of a sample has no next token
    assert b.positions[end0] == 1 and b.positions[t] == t + 1
    # every loss-masked token but a sample's first is a target of step 0
    starts = set(offsets[:-1].tolist())
    assert b.trained_tokens == sum(int(mask[i]) for i in range(len(ids)) if i not in starts)


# ---------------------------------------------------------------- training


def run_train(tiny, out, steps, stop_after=None, ckpt_every=4, seed=0, lr=3e-3):
    """`steps` steps of one pack each (max_steps over many epochs), validated at the end."""
    target, shards = tiny
    vocab = build_draft_vocab(shards, V, 48)
    cfg = TrainConfig(
        epochs=100,
        max_steps=steps,
        batch_packs=1,
        ttt_steps=3,
        lr=lr,
        warmup_ratio=2 / max(steps, 4),
        min_lr_ratio=0.1,
        weight_decay=0.0,
        grad_clip=1.0,
        max_tokens=64,
        save_every=ckpt_every,
        eval_every=0,
        seed=seed,
        # no loader worker in this process: a fork from a pytest worker, which runs threads,
        # can deadlock in the child. The rule runs (subprocesses) train with workers.
        num_workers=0,
        device="cpu",
    )
    return train(shards, target, vocab, out, cfg, TINY_DRAFT, stop_after=stop_after)


def test_ttt_loss_decreases(tiny, tmp_path):
    run_train(tiny, tmp_path / "run", steps=60, ckpt_every=60, lr=1e-2)
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert len(rows) == 60
    first = sum(float(r["loss"]) for r in rows[:5]) / 5
    last = sum(float(r["loss"]) for r in rows[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert float(rows[-1]["acc_0"]) > float(rows[0]["acc_0"]) + 0.2
    for k in range(3):  # every TTT step learns
        assert float(rows[-1][f"loss_{k}"]) < float(rows[0][f"loss_{k}"])
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000


def test_trainer_runs_on_fp8_shards(tiny, tmp_path):
    """The same shards stored in fp8: packs dequantize to the bf16 states within fp8's error,
    and training learns as on bf16 (same seed, same steps)."""
    target, bf16_shards = tiny
    fp8_shards = [
        write_shard(tmp_path / f"fp8-{i}.safetensors", 12, seed=i, storage_dtype=FP8)
        for i in range(2)
    ]
    a, b = first_pack(bf16_shards), first_pack(fp8_shards)
    # fp8 packs hold the codes and their scales (what crosses to the device), dequantized there
    assert a.states.dtype == torch.bfloat16 and not a.scales.numel()
    assert b.states.dtype == torch.float8_e4m3fn and b.scales.shape == b.states.shape[:2]
    assert torch.equal(a.tokens, b.tokens)
    (a_aux, a_final), (b_aux, b_final) = a.values(), b.values()
    assert b_aux.dtype == torch.float32
    for x, y in ((a_aux, b_aux), (a_final, b_final)):
        rel = (y - x).norm(dim=-1) / x.norm(dim=-1)
        assert rel.max() < 0.07 and not torch.equal(x, y)
    run_train((target, fp8_shards), tmp_path / "fp8", steps=60, ckpt_every=60, lr=1e-2)
    run_train(tiny, tmp_path / "bf16", steps=60, ckpt_every=60, lr=1e-2)
    losses = {}
    for arm in ("fp8", "bf16"):
        rows = list(csv.DictReader(open(tmp_path / arm / "metrics.csv")))
        assert len(rows) == 60
        losses[arm] = [sum(float(r["loss"]) for r in part) / 5 for part in (rows[:5], rows[-5:])]
    print("mean loss of the first and last 5 steps:", losses)
    first, last = losses["fp8"]
    assert last < 0.6 * first, losses
    assert abs(last - losses["bf16"][1]) < 0.1 * losses["bf16"][1], losses


def test_resume_after_crash_equals_uninterrupted_run(tiny, tmp_path):
    run_train(tiny, tmp_path / "straight", steps=10)
    # the last two checkpoints are kept (one lost or damaged leaves the one before)
    kept = sorted(d.name for d in (tmp_path / "straight" / "checkpoints").iterdir())
    assert kept == ["step-00000008", "step-00000010"]
    # "crash" after step 7: the last checkpoint is step 4, steps 5-7 are lost and redone
    first = run_train(tiny, tmp_path / "crashed", steps=10, stop_after=7)
    assert first["end_step"] == 7
    assert [d.name for d in (tmp_path / "crashed" / "checkpoints").iterdir()] == ["step-00000004"]
    second = run_train(tiny, tmp_path / "crashed", steps=10)
    assert second["start_step"] == 4
    a, _ = load_trained(tmp_path / "straight")
    b, _ = load_trained(tmp_path / "crashed")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    rows_a = list(csv.DictReader(open(tmp_path / "straight" / "metrics.csv")))
    rows_b = list(csv.DictReader(open(tmp_path / "crashed" / "metrics.csv")))
    assert [r["step"] for r in rows_b] == [str(i) for i in range(1, 11)]
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    # a different seed is a different run
    run_train(tiny, tmp_path / "seed1", steps=10, seed=1)
    c, _ = load_trained(tmp_path / "seed1")
    assert not torch.equal(a.fc.weight, c.fc.weight)
    # ... also where the other seed's finished checkpoint is left (train.work/ survives a
    # config change): it is not resumed, and the result is the fresh seed-1 run's
    again = run_train(tiny, tmp_path / "straight", steps=10, seed=1)
    assert again["start_step"] == 0 and again["end_step"] == 10
    d, _ = load_trained(tmp_path / "straight")
    for (name, x), (_, y) in zip(c.state_dict().items(), d.state_dict().items()):
        assert torch.equal(x, y), name


# ---------------------------------------------------------------- export


def test_export_names_config_and_aux_ids_from_shards(tiny, tmp_path):
    target, shards = tiny
    run_train(tiny, tmp_path / "run", steps=2, ckpt_every=2)
    draft, ckpt = load_trained(tmp_path / "run")
    out = tmp_path / "export"
    config = export_draft(draft, ckpt["aux_ids"], shards, target, out, speculative_tokens=3)
    on_disk = json.loads((out / "config.json").read_text())
    assert on_disk == json.loads(json.dumps(config))
    assert on_disk["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # the shards' ids minus L
    assert on_disk["speculators_model_type"] == "eagle3"
    assert on_disk["draft_vocab_size"] == 48 and on_disk["target_hidden_size"] == H
    assert on_disk["speculators_config"]["verifier"] == {
        "name_or_path": str(target),
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    assert on_disk["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tl = on_disk["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["num_hidden_layers"] == 1 and tl["vocab_size"] == V
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == SPECULATORS_NAMES
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("fc.weight").shape == (H, 3 * H)
        assert f.get_tensor("lm_head.weight").shape == (48, H)
    assert (torch.arange(48) + d2t).tolist() == t2d.nonzero().flatten().tolist()
    # vLLM's own config translation sees an Eagle3 llama draft with these ids
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(
        json.loads((out / "config.json").read_text())
    )
    assert hf["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and hf["draft_vocab_size"] == 48


def test_a_draft_over_the_whole_target_vocabulary_exports_no_id_maps(tiny):
    """draft.vocab_size at (or above) the target's: vLLM builds no draft_id_to_target_id and
    refuses a d2t in the file, so none is written (the ids are the target's, in order)."""
    from eagleflow.draft.weights import build_draft
    from eagleflow.export.speculators_format import export_tensors

    target, shards = tiny
    draft = build_draft(target, build_draft_vocab(shards, V, V), 3, 0, "random", **TINY_DRAFT)
    names = set(export_tensors(draft, torch.bfloat16))
    assert names == SPECULATORS_NAMES - {"d2t", "t2d"}


def test_export_refuses_disagreeing_shards_or_ids(tiny, tmp_path):
    target, shards = tiny
    run_train(tiny, tmp_path / "run", steps=1, ckpt_every=1)
    draft, ckpt = load_trained(tmp_path / "run")
    odd = write_shard(tmp_path / "odd.safetensors", 3, seed=5, layer_ids=[0, 2, 3, L])
    with pytest.raises(ValueError, match="differ"):
        export_draft(draft, ckpt["aux_ids"], shards + [odd], target, tmp_path / "x")
    with pytest.raises(ValueError, match="trained on aux ids"):
        export_draft(draft, [0, 2, 3], shards, target, tmp_path / "x")
    no_final = write_shard(tmp_path / "nofinal.safetensors", 3, seed=6, layer_ids=[1, 2, 3, 0])
    with pytest.raises(ValueError, match="final pre-norm"):
        read_layout([no_final], L)


# ---------------------------------------------------------------- vLLM loads the export


# A short training run of the small default's draft: 12 steps of 2 packs (so 1 or 2 ranks take
# the same steps), validated and checkpointed every 6; evaluated on 3 held-out prompts.
DRAFT_RUN = {
    "draft": {
        "vocab_size": 256,
        "max_steps": 12,
        "batch_packs": 2,
        "save_every": 6,
        "eval_every": 6,
        "max_tokens": 256,
        "warmup_ratio": 0.2,
    },
    "evaluate": {
        "num_prompts": 3,
        "max_tokens": 10,
        "speculative_tokens": 2,
        "paths": ["vllm_eagle3", "reference"],
        "sets": [{"name": "heldout"}],
    },
}

# The one-rank run's evaluation as a user compares it with published cards: the held-out
# split, a small MT-Bench file in its published format (categories; one question of two turns,
# one of a single turn, to keep the reference loop's turns few), the embedded HumanEval's first
# problem, at k = 1 and 2 (one engine more than one k).
MT_BENCH_ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["Tell me a story.", "Make it shorter."]},
    {"question_id": 82, "category": "reasoning", "turns": ["What is two plus two?"]},
]


def compared_sets(folder: Path) -> dict:
    mt = folder / "question.jsonl"
    mt.write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH_ROWS))
    return {
        "evaluate": {
            "speculative_tokens": [1, 2],
            "sets": [
                {"name": "heldout"},
                {"name": "mt_bench", "path": str(mt)},
                {"name": "humaneval", "path": "embedded:humaneval", "limit": 1},
            ],
        }
    }


def draft_run(extracted_workdir, work, override=None, target="all"):
    """`snakemake <target>` on a copy of the extracted small default; the run's config."""
    from support.workflow_runner import SMALL, copy_workdir, merged, snakemake

    copy_workdir(extracted_workdir, work)
    config = merged(merged(SMALL, DRAFT_RUN), override or {})
    return snakemake(work, target, config=config), config


def exported(work: Path) -> str:
    """The exported draft's weights file, as a target relative to the run's directory."""
    from support.workflow_runner import hidden_dir

    return f"results/draft/{hidden_dir(work).name}/export/model.safetensors"


def assert_same_export(work: Path, reference: Path, rtol: float):
    """The draft exported in `work` is `reference`'s: the same config, the same tensors by name,
    shape and dtype, and values within `rtol` (relative to each tensor's norm). One export
    that vLLM loads and evaluates (test_all_trains_exports_and_evaluates_the_draft_in_vllm)
    then stands for both."""
    a_dir, b_dir = (w / Path(exported(w)).parent for w in (work, reference))
    a_cfg, b_cfg = (json.loads((d / "config.json").read_text()) for d in (a_dir, b_dir))
    assert a_cfg == b_cfg
    a, b = (load_file(str(d / "model.safetensors")) for d in (a_dir, b_dir))
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
        x, y = a[name].float(), b[name].float()
        rel = float((x - y).norm() / y.norm().clamp_min(1e-12))
        worst = max(worst, rel)
        assert rel <= rtol, (name, rel)
    print(f"exported drafts: largest relative difference of a tensor {worst:.2e}")


@pytest.fixture(scope="module")
def one_rank(extracted_workdir, tmp_path_factory):
    """The draft of the small default trained, exported and evaluated at one rank."""
    work = tmp_path_factory.mktemp("draft-one-rank") / "run"
    proc, config = draft_run(
        extracted_workdir, work, compared_sets(tmp_path_factory.mktemp("sets"))
    )
    return work, proc, config


def draft_outputs(work: Path, evaluated: bool = True) -> dict:
    from support.workflow_runner import hidden_dir

    fp = hidden_dir(work).name
    train = work / "results" / "draft" / fp / "train"
    with open(train / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    outputs = {
        "fp": fp,
        "train": train,
        "summary": json.loads((train / "summary.json").read_text()),
        "losses": [float(r["loss"]) for r in metrics],
        "steps": [int(r["step"]) for r in metrics],
        "log": (work / "results" / "logs" / "train_draft" / f"{fp}.log").read_text(),
    }
    if evaluated:
        acceptance = work / "results" / "eval" / fp / "acceptance.json"
        outputs["acceptance"] = json.loads(acceptance.read_text())
    return outputs


@pytest.mark.vllm
def test_all_trains_exports_and_evaluates_the_draft_in_vllm(one_rank):
    """`snakemake` (rule all) on a copy of the extracted small default: no re-extraction; the
    draft vocabulary, a short training run, the export of its best draft, and `evaluate`,
    which loads target + exported draft in vLLM (method eagle3) on held-out prompts and runs
    the reference loop; then `--report` holds the training curves, the acceptance plot and
    the verification table."""
    from eagleflow.data.heldout import is_heldout
    from support.workflow_runner import hidden_dir, job_counts, snakemake

    work, proc, config = one_rank
    counts = job_counts(proc.stdout + proc.stderr)
    assert "extract_shard" not in counts and "shard" not in counts, counts
    assert all(
        counts.get(r) == 1 for r in ("draft_vocab", "train_draft", "export_draft", "evaluate")
    ), counts
    out = draft_outputs(work)
    results = work / "results"
    layer_ids = json.loads((hidden_dir(work) / "capture_plan.json").read_text())["layer_ids"]
    export = json.loads((results / "draft" / out["fp"] / "export" / "config.json").read_text())
    assert (
        export["eagle_aux_hidden_state_layer_ids"] == layer_ids[:-1]
        and export["draft_vocab_size"] == 256
    )
    # draft.architecture auto on the DeepseekV3 target: an MLA draft of the target's shape
    target = json.loads((work / out["acceptance"]["target"] / "config.json").read_text())
    assert export["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    mla_keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
    assert {k: export[k] for k in mla_keys} == {k: target[k] for k in mla_keys}
    vocab = json.loads((results / "draft" / out["fp"] / "vocab.json").read_text())
    assert 0.5 < vocab["coverage"] <= 1 and 0 < vocab["heldout_coverage"] <= 1
    assert out["steps"] == list(range(1, 13))
    with open(out["train"] / "validation.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [6, 12]
    summary = out["summary"]
    assert summary["world_size"] == 1 and summary["samples_cut"] == 0
    assert summary["parallelism"] == "single process" and summary["end_step"] == 12
    assert summary["best_step"] in (6, 12) and summary["simulated_acceptance_length"]["total"] >= 1
    best = json.loads((out["train"] / "best" / "draft.json").read_text())
    assert (
        best["step"] == summary["best_step"]
        and (out["train"] / "best" / "model.safetensors").is_file()
    )
    # the trainer's checkpoints stay outside the outputs (train.work/), the last two kept
    work_dir = out["train"].parent / "train.work"
    kept = sorted(d.name for d in (work_dir / "checkpoints").iterdir())
    assert kept[-1] == "step-00000012" and len(kept) <= 2
    report = out["acceptance"]
    assert report["ks"] == [1, 2] and report["temperature"] == 0.0
    # evaluate.mla null: vLLM serves the MLA draft with MLA on, each of its engines
    assert report["draft_architecture"] == "mla" and report["vllm_mla_disabled"] is False
    assert [x["vllm_mla"] for x in report["loads"] if x["path"] == "vllm_eagle3"] == [True, True]
    assert all(is_heldout(s) for s in report["heldout"]["sample_ids"])
    assert report["sets"]["heldout"]["prompts"] == 3
    assert report["sets"]["mt_bench"]["categories"] == {"writing": 1, "reasoning": 1}
    assert report["sets"]["mt_bench"]["format"] == "mt_bench"  # detected
    assert report["sets"]["humaneval"]["sample_ids"] == ["HumanEval/0"]
    # one vLLM engine per k; the reference loop loads once for both
    assert report["engine_loads"] == 2
    log = (results / "logs" / "evaluate" / f"{out['fp']}.log").read_text()
    assert "engine loads: 2 vLLM engine(s)" in log
    for name in ("heldout", "mt_bench", "humaneval"):
        for k in (1, 2):
            eagle, ref = (report["runs"][name][str(k)][p] for p in ("vllm_eagle3", "reference"))
            assert "error" not in eagle, eagle.get("stderr_tail")
            assert "error" not in ref, ref
            assert eagle["num_drafts"] > 0 and len(eagle["num_accepted_tokens_per_pos"]) == k
            assert 1 <= eagle["acceptance_length"] <= k + 1 and ref["num_drafts"] > 0
            assert eagle["prompts"] == report["sets"][name]["prompts"] - eagle["prompts_skipped"]
            agreement = eagle["greedy_agreement_with_reference"]
            assert 0 <= agreement["tokens_before_divergence"] <= 1
    # The AL definition on this run: per set, 1 + accepted / drafts, the sets' counters adding
    # up to vLLM's own spec-decode totals of the engine (LLM.get_metrics()).
    for load in (x for x in report["loads"] if x["path"] == "vllm_eagle3"):
        (k,) = load["ks"]
        vllm = load["counters"][str(k)]
        sets = [report["runs"][name][str(k)]["vllm_eagle3"] for name in report["sets"]]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert sum(r[key] for r in sets) == vllm[key], key
        assert [sum(x) for x in zip(*(r["num_accepted_tokens_per_pos"] for r in sets))] == vllm[
            "num_accepted_tokens_per_pos"
        ]
        assert vllm["num_draft_tokens"] == k * vllm["num_drafts"]
        for r in sets:
            assert r["acceptance_length"] == 1 + r["num_accepted_tokens"] / r["num_drafts"]
    # MT-Bench's second turn was asked after the target's own first reply: its prompt is the
    # chat template over question, that reply (decoded) and the second question.
    from eagleflow.evaluate.turns import chat_renderer
    from eagleflow.target.load import load_tokenizer

    render = chat_renderer(load_tokenizer(work / report["target"]))
    mt = report["runs"]["mt_bench"]["2"]["vllm_eagle3"]
    assert [len(t) for t in mt["texts"]] == [2, 1] and report["sets"]["mt_bench"]["turns"] == 3
    (first, second), replies, lengths = (
        MT_BENCH_ROWS[0]["turns"],
        mt["texts"][0],
        mt["prompt_tokens"][0],
    )
    history = [{"role": "user", "content": first}]
    assert lengths[0] == len(render(history))
    history += [{"role": "assistant", "content": replies[0]}]
    assert lengths[1] == len(render(history + [{"role": "user", "content": second}]))
    assert set(mt["by_category"]) == {"writing", "reasoning"}
    table = (results / "eval" / out["fp"] / "acceptance.md").read_text()
    assert "| engine | k | temperature | heldout | mt_bench | humaneval |" in table
    for k in (1, 2):
        row = [r for r in report["runs"].values()]
        cells = " | ".join(f"{r[str(k)]['vllm_eagle3']['acceptance_length']:.2f}" for r in row)
        assert f"| vLLM eagle3 | {k} | 0 (greedy) | {cells} |" in table
    assert "| mt_bench | writing | vLLM eagle3 | 2 | 0 (greedy) |" in table
    assert "| draft architecture | mla (vLLM's Eagle3DeepseekV2ForCausalLM) |" in table
    print(f"one rank, k=1,2 eagle3:\n{table}")
    html = work / "report.html"
    snakemake(work, "--report", str(html), config=config)
    text = html.read_text(errors="replace")
    assert all(
        name in text
        for name in ("curves.png", "acceptance.png", "acceptance.md", "verify_summary.tsv")
    )


@pytest.mark.vllm
def test_two_ranks_train_through_the_rule_as_one_rank_does(extracted_workdir, one_rank, tmp_path):
    """`draft: {processes_per_node: 2}`: train_draft starts 2 ranks under torchrun (FSDP on
    gloo) on the same extraction; with the same global batch and seed they take the steps the
    one-rank run took, every sample is trained, and they export the one-rank run's draft (the
    same files, weights within bf16 rounding), which vLLM loads and evaluates there."""
    override = {"draft": {"processes_per_node": 2}}
    work = tmp_path / "run"
    draft_run(extracted_workdir, work, override, target=exported(extracted_workdir))
    two, one = draft_outputs(work, evaluated=False), draft_outputs(one_rank[0])
    summary = two["summary"]
    assert summary["world_size"] == 2 and summary["parallelism"] == "fsdp (gloo)", summary
    assert summary["samples_cut"] == 0 and summary["micro_steps_per_rank"] == 1
    assert "torch.distributed.run --standalone --nnodes 1 --nproc_per_node 2" in two["log"]
    assert two["steps"] == one["steps"]
    # The default's Muon orthogonalizes in bf16 (torch), where the ranks' gradient sums, added
    # in another order, round apart; AdamW runs agree to 1e-5 (test_train_distributed.py).
    torch.testing.assert_close(two["losses"], one["losses"], rtol=1e-3, atol=0)
    for key in ("tokens_trained", "samples_trained", "best_step"):
        assert summary[key] == one["summary"][key], key
    assert_same_export(work, one_rank[0], rtol=2e-2)


@pytest.mark.vllm
def test_stream_run_writes_no_state_and_trains_the_stored_batches(
    extracted_workdir, one_rank, tmp_path
):
    """`draft.states: stream` (docs/streaming.md) on a copy of the extracted small default
    whose extracted shards are deleted: `all` would extract nothing; the exported draft's run
    gets every pack's states from the capture engine server, writes no byte of states, takes
    the stored run's steps with its losses (the same packs; the states within the engine's
    run-to-run noise: on this CPU, bit-identical) and exports the stored run's draft, which
    vLLM loads and evaluates there. The served packs themselves are compared with the stored
    ones, then the server started for that is stopped."""
    import re
    from dataclasses import replace

    from eagleflow.serve.client import stop_server
    from eagleflow.train.data import PackPlan, layout_of
    from eagleflow.train.states import ServedStates, StreamSource
    from support.workflow_runner import (
        SMALL,
        copy_workdir,
        hidden_dir,
        job_counts,
        merged,
        snakemake,
    )

    work = tmp_path / "run"
    copy_workdir(extracted_workdir, work)
    hidden = hidden_dir(work)
    for path in hidden.iterdir():  # every extracted shard, record, report and the summary
        if re.fullmatch(r"[0-9a-f]{20}\..*", path.name) or path.name == "verify_summary.tsv":
            path.unlink()
    config = merged(merged(SMALL, DRAFT_RUN), {"draft": {"states": "stream"}})
    planned = job_counts(snakemake(work, "-n", config=config).stdout)  # `all`, dry
    assert "extract_shard" not in planned and planned.get("evaluate") == 1, planned
    proc = snakemake(work, exported(work), config=config)
    counts = job_counts(proc.stdout + proc.stderr)
    assert "extract_shard" not in counts and counts.get("train_draft") == 1, counts
    states = [p for p in (work / "results").rglob("*.safetensors") if hidden in p.parents]
    assert states == [] and not (hidden / "cache").exists()
    out, one = draft_outputs(work, evaluated=False), draft_outputs(one_rank[0])
    assert "states from the capture server" in out["log"]
    assert out["steps"] == one["steps"]
    torch.testing.assert_close(out["losses"], one["losses"], rtol=1e-3, atol=0)
    for key in ("tokens_trained", "samples_trained"):
        assert out["summary"][key] == one["summary"][key], key
    assert_same_export(work, one_rank[0], rtol=2e-2)

    # The packs the server streams are the stored packs.
    source = StreamSource.load(out["train"].parent / "train.work" / "stream.json")
    source = replace(source, server=replace(source.server, watch_pid=os.getpid()))
    stored = sorted(str(p) for p in hidden_dir(extracted_workdir).glob("*.safetensors"))
    tokens = sorted(str(p) for p in (work / "results" / "shards" / "tokens").glob("*.safetensors"))
    num_layers = source.plan.num_hidden_layers
    layout = read_layout(stored, num_layers)
    table = sample_table(layout.paths)
    served_layout = layout_of(tokens, source.plan.layer_ids, num_layers)
    cwd = os.getcwd()
    os.chdir(work)  # the spec's paths are the run's, relative to its directory
    try:
        served = PackDataset(
            served_layout,
            sample_table(tokens),
            3,
            source=ServedStates(source, served_layout.paths),
        )
        packs = PackPlan(table, 256, 2, 0)
        for p in range(3):
            a, b = PackDataset(layout, table, 3)[packs.pack(0, p)], served[packs.pack(0, p)]
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.valid, b.valid)
            for x, y in zip(a.values(), b.values()):
                torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)
    finally:
        stop_server(source.server)
        os.chdir(cwd)


def test_greedy_agreement_counts_tokens_up_to_the_first_difference():
    from eagleflow.evaluate.acceptance import greedy_agreement

    ref = [[5, 6, 7, 2], [8, 9, 2], [4, 2]]
    assert greedy_agreement(ref, ref) == {"identical_prompts": 1.0, "tokens_before_divergence": 1.0}
    got = greedy_agreement([[5, 6, 1, 2], [8, 9, 2], [3, 2]], ref)
    assert got == {"identical_prompts": 1 / 3, "tokens_before_divergence": (2 + 3 + 0) / 9}
    with pytest.raises(ValueError, match="2 outputs against 3"):
        greedy_agreement(ref[:2], ref)


# ---------------------------------------------------------------- the draft's forward == vLLM's


def perturbed_export(tiny, out, norm_before_residual, seed, **arch):
    """An exported draft with a pruned vocabulary and non-trivial weights everywhere (norms
    included), so every placement (hidden_norm, residual, fc order, d2t) shows; `arch`:
    DraftConfig options (fc_norm, norm_output)."""
    from eagleflow.draft.weights import build_draft

    target, shards = tiny
    vocab = build_draft_vocab(shards, V, 48)
    draft = build_draft(
        target,
        vocab,
        3,
        seed=seed,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        norm_before_residual=norm_before_residual,
        **arch,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "embed_tokens.weight":
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    export_draft(draft, [1, 2, 3], shards, target, out, dtype="float32")
    return draft, vocab


@pytest.mark.slow
def test_draft_forward_matches_vllm_eagle3_module(tiny, tmp_path):
    """eagleflow's TTT forward (what training optimises) against vLLM 0.32's own
    Eagle3LlamaForCausalLM loaded from the export (config translation, load_weights, d2t,
    forward, compute_logits), drafting three tokens for the last position of a prompt the
    way vLLM's proposer does. Both residual variants, and "Eagle 3.1" (fc_norm, norm_output)."""
    n, steps = 9, 3
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(n, 3 * H, generator=g)
    seq = torch.randint(0, V, (n + steps,), generator=g)
    tokens = torch.stack([seq[1 + k : 1 + k + n] for k in range(steps)])  # step k reads t+1+k
    variants = [(True, {}), (False, {}), (True, {"fc_norm": True, "norm_output": True})]
    drafts, dirs = [], []
    for i, (nbr, arch) in enumerate(variants):
        d = tmp_path / f"export{i}"
        drafts.append(perturbed_export(tiny, d, nbr, seed=i, **arch))
        dirs.append(str(d))
    results = vllm_reference_drafts("vllm_eagle3_reference.py", tmp_path, aux, tokens, dirs)
    for (draft, vocab), res, (nbr, arch) in zip(drafts, results, variants):
        assert res["norm_before_residual"] is nbr and res["draft_vocab_size"] == 48
        assert res["fc_norm"] is arch.get("fc_norm", False)
        assert res["norm_output"] is arch.get("norm_output", False)
        with torch.no_grad():  # eagleflow: positions of token t+1 (vLLM: t); RoPE is relative
            ours = draft.ttt_forward(
                aux, tokens, torch.arange(n) + 1, torch.zeros(n, dtype=torch.long), steps
            )
        theirs = res["logits"]  # [steps, V], -inf outside the draft vocabulary
        assert (
            torch.isinf(theirs[:, ~vocab.t2d]).all() and torch.isfinite(theirs[:, vocab.t2d]).all()
        )
        for k in range(steps):
            torch.testing.assert_close(
                theirs[k, vocab.target_ids], ours[k][-1], atol=1e-4, rtol=1e-4
            )
        # and the greedy proposals agree (target ids)
        assert (
            theirs.argmax(-1) == vocab.target_ids[torch.stack([o[-1] for o in ours]).argmax(-1)]
        ).all()


# ---------------------------------------------------------------- held-out split and acceptance


@pytest.mark.slow
def test_heldout_split_is_by_content_hash_and_stable():
    from eagleflow.data.conversations import Conversation
    from eagleflow.data.heldout import heldout_prompts, is_heldout, split

    convs = [
        Conversation(
            f"{i:016x}",
            ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}),
            "f",
            i,
        )
        for i in range(2000)
    ]
    train_part, held = split(convs)
    assert 60 < len(held) < 140 and len(train_part) + len(held) == 2000  # about 1 in 20
    assert {c.sample_id for c in held} == {c.sample_id for c in convs if is_heldout(c.sample_id)}
    assert split(list(reversed(convs)))[1] == list(reversed(held))  # order does not matter
    p = heldout_prompts(convs, limit=3)
    assert len(p) == 3 and p[0]["messages"] == [
        {"role": "user", "content": p[0]["messages"][0]["content"]}
    ]
    assert p[0]["reference"].startswith("a")


def test_heldout_samples_are_in_no_pack_and_not_in_the_vocabulary(tiny):
    from eagleflow.data.heldout import excluder
    from eagleflow.draft.vocab import count_masked_tokens
    from eagleflow.train.data import shard_metadata

    _, shards = tiny
    exclude = excluder(4)
    held_rows, train_rows = set(), set()
    expected = torch.zeros(V, dtype=torch.long)
    for s, path in enumerate(shards):
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets").tolist()
            ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask").bool()
        for i, sid in enumerate(shard_metadata(path)["sample_ids"]):
            rows = {(s, r) for r in range(offsets[i], offsets[i + 1])}
            if exclude(sid):
                held_rows |= rows
            else:
                train_rows |= rows
                seg = slice(offsets[i], offsets[i + 1])
                expected += torch.bincount(ids[seg][mask[seg]], minlength=V)
    assert held_rows and train_rows
    from eagleflow.train.data import HeldoutSampler, PackPlan

    table = sample_table(shards, exclude)
    plan = PackPlan(table, 40, 1, seed=0)

    def rows_of(samples):
        return {
            (int(table.shard[i]), r)
            for i in samples
            for r in range(table.start[i], table.start[i] + table.length[i])
        }

    packed = [plan.pack(0, p) for p in range(plan.num_packs(0))]
    assert sorted(i for pack in packed for i in pack) == sorted(table.train.tolist())
    assert rows_of(i for pack in packed for i in pack) == train_rows  # every row, none held out
    assert rows_of(i for pack in HeldoutSampler(table, 40, 0, 1) for i in pack) == held_rows
    assert torch.equal(count_masked_tokens(shards, V, exclude=exclude), expected)


def test_reference_loop_counts_like_vllm(monkeypatch):
    """Counters of the reference loop: a target whose greedy next token is last+1, a draft
    proposing last+1, last+2 and a wrong third token: every draft run accepts exactly 2."""
    import eagleflow.evaluate.acceptance as acc

    def target(ids):
        return torch.tensor([(t + 1) % 1000 for t in ids]), torch.zeros(len(ids), 4)

    monkeypatch.setattr(
        acc,
        "propose",
        lambda draft, aux, shifted, k: [int(shifted[-1]) + 1, int(shifted[-1]) + 2, 999],
    )
    r = acc.reference_acceptance(
        target, None, [{"prompt_token_ids": [5, 6, 7]}], k=3, max_tokens=10
    )
    # prefill gives 8; each run appends 2 drafts + the target's token: 8 | 9 10 11 | 12 13 14 | 15
    # 16 17
    assert r["output_token_ids"] == [list(range(8, 18))]
    assert r["num_drafts"] == 3 and r["num_accepted_tokens"] == 6 and r["num_draft_tokens"] == 9
    assert r["num_accepted_tokens_per_pos"] == [3, 3, 0] and r["acceptance_length"] == 3.0
    # end of turn stops the loop, and tokens after it are dropped
    r = acc.reference_acceptance(
        target, None, [{"prompt_token_ids": [5]}], k=3, max_tokens=10, eos_token_id=9
    )
    assert r["output_token_ids"] == [[6, 7, 8, 9]]


def test_propose_and_load_export_round_trip(tiny, tmp_path):
    """The exported draft reloads as the same model; proposals are its greedy TTT tokens."""
    from eagleflow.evaluate.acceptance import load_export, plot, propose, summarize

    draft, vocab = perturbed_export(tiny, tmp_path / "export", True, seed=3)
    back, cfg = load_export(tmp_path / "export")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    for (name, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    g = torch.Generator().manual_seed(1)
    aux, shifted = torch.randn(6, 3 * H, generator=g), torch.randint(0, V, (6,), generator=g)
    proposals = propose(back, aux, shifted, 3)
    assert len(proposals) == 3 and all(bool(vocab.t2d[t]) for t in proposals)
    tokens = shifted.unsqueeze(0).repeat(3, 1)
    tokens[1, -1], tokens[2, -1] = proposals[0], proposals[1]
    with torch.no_grad():
        logits = back.ttt_forward(
            aux, tokens, torch.arange(6) + 1, torch.zeros(6, dtype=torch.long), 3
        )
    assert [int(vocab.target_ids[lg[-1].argmax()]) for lg in logits] == proposals
    s = summarize(
        {
            "num_drafts": 4,
            "num_draft_tokens": 12,
            "num_accepted_tokens": 6,
            "num_accepted_tokens_per_pos": [3, 2, 1],
        },
        3,
    )
    assert s["acceptance_length"] == 2.5 and s["acceptance_rate_per_pos"] == [0.75, 0.5, 0.25]
    plot({"reference": s, "vllm_eagle3": {"error": "exit 1"}}, 3, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").stat().st_size > 1000
