"""fp8 storage of hidden states (`capture.storage_dtype: float8_e4m3fn`): quantization round
trip, the shard layout through the real shard-file path, verification of scales, readers, the
fingerprint and the byte estimates, and an fp8 extraction through vLLM against the shared bf16
one."""

import json
import struct

import pandas as pd
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagleflow.capture.plan import CaptureCheckError, CapturePlan, make_plan
from eagleflow.extract.fingerprint import extraction_fingerprint
from eagleflow.store.headers import read_header
from eagleflow.store.quant import (
    FP8,
    FP8_MAX,
    MIN_SCALE,
    SCALES_KEY,
    ShardStates,
    StorageError,
    bytes_per_token,
    dequantize,
    quantize,
    read_states,
    row_peaks,
)
from eagleflow.store.verify import Expected, ShardInvalid, verify_extracted_shard, verify_shard
from support.synthetic import FP, PLAN, make_extracted_shard, make_token_shards


def row_errors(x, y):
    """Per-row relative L2 error and cosine of y against x, over the last dimension."""
    x, y = x.float(), y.float()
    rel = (y - x).norm(dim=-1) / x.norm(dim=-1)
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    return rel, cos


# ---------------------------------------------------------------- quantization


def test_round_trip_on_known_tensors_gives_exact_scales():
    x = torch.tensor(
        [
            [448.0, -224.0, 1.0, 0.0],  # amax 448: scale 1, every value exact in e4m3
            [-896.0, 448.0, 2.0, -0.5],  # amax 896: scale 2
            [0.0, 0.0, 0.0, 0.0],  # all zero: the floor scale, values stay 0
            [1e-3, -1e-3, 5e-4, 0.0],  # tiny magnitudes: a scale of their own, not flushed
        ]
    )
    original = x.clone()
    q, s = quantize(x)
    assert torch.equal(x, original)  # the caller's tensor is left alone
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (4,)
    assert s[0] == 1.0 and s[1] == 2.0 and s[2] == MIN_SCALE
    assert torch.allclose(s[3], torch.tensor(1e-3 / FP8_MAX))
    back = dequantize(q, s)
    assert torch.equal(back[:3], x[:3])
    assert torch.allclose(back[3], x[3], rtol=1e-6, atol=0)
    # The row maximum maps to +-448, never beyond (a cast past 448 would give NaN).
    assert q.float().abs().amax(dim=-1)[[0, 1, 3]].tolist() == [448.0] * 3


def test_round_trip_on_random_states_is_within_the_error_bound():
    g = torch.Generator().manual_seed(0)
    # Layers several orders of magnitude apart, as in real residual streams, one scale each.
    x = torch.randn(512, 4, 256, generator=g) * torch.tensor([1e-2, 1.0, 30.0, 1e3])[:, None]
    x = x.bfloat16()
    q, s = quantize(x)
    assert q.shape == x.shape and s.shape == (512, 4)
    rel, cos = row_errors(x, dequantize(q, s))
    assert rel.max() <= 0.07, float(rel.max())
    assert cos.min() >= 0.999, float(cos.min())
    assert 0.01 < float(rel.median()) < 0.04  # e4m3's 3 mantissa bits, not a trivial pass
    assert torch.isfinite(dequantize(q, s)).all()
    assert dequantize(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_bytes_per_token_in_both_layouts():
    assert bytes_per_token(4, 7168, "bfloat16", "bfloat16") == 4 * 7168 * 2
    assert bytes_per_token(4, 7168, "float16", "bfloat16") == 4 * 7168 * 2
    assert bytes_per_token(4, 7168, "bfloat16", FP8) == 4 * (7168 + 4)
    with pytest.raises(StorageError, match="int4"):
        bytes_per_token(4, 7168, "bfloat16", "int4")


# ---------------------------------------------------------------- shards


@pytest.fixture
def shards(tokenizer, tmp_path):
    """The same synthetic states stored both ways through the real shard-file path."""
    shard = make_token_shards(tokenizer)[0]
    _, bf16, bf16_record = make_extracted_shard(shard, tmp_path / "bf16")
    _, fp8, record = make_extracted_shard(shard, tmp_path / "fp8", storage_dtype=FP8)
    return shard, bf16, fp8, record


def expected(storage=FP8):
    return Expected(FP, PLAN.layer_ids, PLAN.hidden_size, "bfloat16", storage)


def test_fp8_shard_layout_size_and_values(shards):
    shard, bf16, fp8, record = shards
    header, _ = read_header(fp8)
    T, n = len(shard.input_ids), len(PLAN.layer_ids)
    assert header["hidden_states"]["dtype"] == "F8_E4M3"
    assert header["hidden_states"]["shape"] == [T, n, PLAN.hidden_size]
    assert header[SCALES_KEY] == header[SCALES_KEY] | {"dtype": "F32", "shape": [T, n]}
    assert header["__metadata__"]["storage_dtype"] == FP8
    assert read_header(bf16)[0]["__metadata__"]["storage_dtype"] == "bfloat16"
    # H = 16 here: (16 + 4) / 32 bytes per token and layer, plus the tokens' own 17 bytes (the
    # headers, padded to a page, left out).
    data_bytes = [p.stat().st_size - read_header(p)[1] for p in (fp8, bf16)]
    assert data_bytes[0] < 0.7 * data_bytes[1]
    with safe_open(str(bf16), "pt") as a, safe_open(str(fp8), "pt") as b:
        ref, got = read_states(a, bf16), read_states(b, fp8)
        assert ref.dtype == torch.bfloat16 and got.dtype == torch.float32
        rel, cos = row_errors(ref, got)
        assert rel.max() <= 0.07 and cos.min() >= 0.999
        assert torch.equal(read_states(b, fp8, slice(5, 9)), got[5:9])
        assert torch.equal(ShardStates(b, fp8)[5:9], got[5:9])
        assert torch.equal(ShardStates(a, bf16)[5:9], ref[5:9])
    assert verify_shard(fp8, shard, record, expected(), deep=True)["ok"]


def write_at(path, tensor: str, index: int, value: float):
    """Overwrite element `index` (flat) of an F32 tensor in place."""
    header, start = read_header(path)
    with open(path, "r+b") as f:
        f.seek(start + header[tensor]["data_offsets"][0] + 4 * index)
        f.write(struct.pack("<f", value))


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -0.25, float("inf")])
def test_verification_catches_a_corrupted_scale(shards, bad):
    shard, _, fp8, record = shards
    n = len(PLAN.layer_ids)
    write_at(fp8, SCALES_KEY, 7 * n + 2, bad)  # token 7, third layer
    problems = verify_shard(fp8, shard, record, expected())["problems"]
    assert len(problems) == 1, problems
    assert SCALES_KEY in problems[0] and "token 7" in problems[0]
    assert f"layer id {PLAN.layer_ids[2]}" in problems[0] and "positive and finite" in problems[0]


def test_verification_dequantizes_before_checking_values(shards):
    shard, _, fp8, record = shards
    header, start = read_header(fp8)
    hs = header["hidden_states"]["data_offsets"][0]
    row = len(PLAN.layer_ids) * PLAN.hidden_size  # bytes per token
    with open(fp8, "r+b") as f:
        f.seek(start + hs + 3 * row + PLAN.hidden_size)  # token 3, layer 1: NaN code 0x7f
        f.write(b"\x7f")
    problems = verify_shard(fp8, shard, record, expected())["problems"]
    assert problems == [f"hidden_states: non-finite value at token 3, layer id {PLAN.layer_ids[1]}"]


def test_verification_catches_a_value_that_overflows_once_dequantized(shards):
    shard, _, fp8, record = shards
    n = len(PLAN.layer_ids)
    # Finite and positive, but the row's peak code (448 for this scale rule) times it is past
    # float32's range: the stored value is not finite.
    write_at(fp8, SCALES_KEY, 5 * n + 3, 1e37)  # token 5, fourth layer
    problems = verify_shard(fp8, shard, record, expected())["problems"]
    assert problems == [f"hidden_states: non-finite value at token 5, layer id {PLAN.layer_ids[3]}"]


def test_row_peaks_equal_the_peaks_of_the_dequantized_values():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 32, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[5, 1] = 0.0  # an all-zero row
    x[6, 2, 7] = -1e4  # a negative peak
    q, s = quantize(x)
    want = dequantize(q, s).abs().amax(dim=-1)
    assert torch.equal(row_peaks(q, s), want)
    assert torch.equal(row_peaks(q.view(torch.uint8), s), want)  # the codes as read from disk
    assert row_peaks(q, s)[5, 1] == 0
    codes = q.view(torch.uint8).clone()
    codes[9, 0, 3] = 0xFF  # a NaN code (negative sign)
    assert torch.isnan(row_peaks(codes, s)[9, 0]) and torch.isfinite(row_peaks(codes, s)[8]).all()
    b = x.bfloat16()
    b[2, 0, 0], b[3, 1, 4] = float("inf"), float("nan")
    peaks = row_peaks(b)
    assert peaks.dtype == torch.float32 and peaks[2, 0] == float("inf") and peaks[3, 1].isnan()
    assert torch.equal(peaks[4], b[4].float().abs().amax(dim=-1))


def drop_scales(path):
    """Rewrite the shard without hidden_scales (what a damaged or foreign file looks like)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    del tensors[SCALES_KEY]
    save_file(tensors, str(path), metadata=meta)


def test_a_shard_without_scales_is_refused_naming_it(shards, tmp_path):
    shard, _, fp8, record = shards
    drop_scales(fp8)
    record = {**record, "bytes": fp8.stat().st_size}
    (problem,) = verify_shard(fp8, shard, record, expected())["problems"]
    assert str(fp8) in problem and shard.shard_id in problem and SCALES_KEY in problem
    with safe_open(str(fp8), "pt") as f, pytest.raises(StorageError, match=str(fp8)):
        read_states(f, fp8)
    with pytest.raises(ShardInvalid, match=f"{shard.shard_id}.*lacks {SCALES_KEY}"):
        verify_extracted_shard(fp8, shard, record, expected(), tmp_path / "report.json")
    assert not fp8.exists()  # quarantined


def test_a_layout_other_than_the_configured_one_is_named(shards):
    shard, bf16, fp8, record = shards
    problems = verify_shard(fp8, shard, record, expected("bfloat16"))["problems"]
    assert problems and SCALES_KEY in problems[0]
    bf16_record = {**record, "bytes": bf16.stat().st_size}
    assert verify_shard(bf16, shard, bf16_record, expected("bfloat16"))["ok"]
    assert not verify_shard(bf16, shard, bf16_record, expected())["ok"]


# ---------------------------------------------------------------- plan and fingerprint


def test_plan_carries_the_storage_dtype_and_old_plans_read_as_default():
    plan = CapturePlan.from_json(PLAN.to_json() | {"storage_dtype": FP8})
    assert plan.storage_dtype == FP8
    old = PLAN.to_json()
    del old["storage_dtype"]  # a capture_plan.json written before the option existed
    assert CapturePlan.from_json(old).storage_dtype == "bfloat16"
    with pytest.raises(CaptureCheckError, match="storage_dtype.*int4"):
        make_plan(None, [2], "auto", storage_dtype="int4")


def test_fingerprint_changes_for_fp8_only():
    args = ({"config.json": "x"}, [2, 4, 5, 8], "vllm", 512, "bfloat16", "auto", "0.32.0")
    old, old_record = extraction_fingerprint(*args)
    same, record = extraction_fingerprint(*args, "bfloat16")
    fp8, fp8_record = extraction_fingerprint(*args, FP8)
    # The default hashes exactly the record of before the option: existing shards stay valid.
    assert same == old and "storage_dtype" not in record
    assert fp8 != old and fp8_record["storage_dtype"] == FP8


def test_progress_estimates_bytes_of_the_storage_dtype(tmp_path):
    import pandas as pd

    from eagleflow.extract.progress import extraction_progress

    manifest = pd.DataFrame({"shard_id": ["a", "b"], "n_tokens": [100, 50]})
    bf16 = extraction_progress(manifest, tmp_path, 4, 256, "bfloat16")
    fp8 = extraction_progress(manifest, tmp_path, 4, 256, "bfloat16", FP8)
    assert bf16["bytes_to_write"] == 150 * 4 * 256 * 2
    assert fp8["bytes_to_write"] == 150 * 4 * (256 + 4)


def test_validate_env_disk_check_uses_the_storage_dtype(fake_deepseek_v3, tmp_path):
    import yaml
    from snakemake.utils import validate as validate_schema

    from eagleflow.extract.preflight import validate
    from support.workflow_runner import REPO

    cfg = yaml.safe_load((REPO / "config/examples/deepseek-v3-tp8.yaml").read_text())
    validate_schema(cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    estimates = {}
    for storage in ("bfloat16", FP8):
        cfg["capture"]["storage_dtype"] = storage
        ok, report = validate(
            cfg, str(fake_deepseek_v3), 10_000, str(tmp_path / "results"), device_checks=False
        )
        assert ok, [c for c in report["checks"] if not c["ok"]]
        (disk,) = [c for c in report["checks"] if c["name"] == "disk"]
        assert disk["ok"] and f"stored as {storage}" in disk["detail"]
        estimates[storage] = report["output_bytes_estimate"]
    n_layers = len(report["layer_ids"])
    assert estimates["bfloat16"] == 10_000 * n_layers * 7168 * 2
    assert estimates[FP8] == 10_000 * n_layers * (7168 + 4)


def test_storage_dtype_is_in_the_schema_with_its_default():
    import yaml

    from support.workflow_runner import REPO

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    prop = schema["properties"]["capture"]["properties"]["storage_dtype"]
    assert prop["default"] == "bfloat16" and prop["enum"] == ["bfloat16", FP8]


# ---------------------------------------------------------------- end to end through vLLM


@pytest.mark.vllm
def test_extract_with_fp8_storage_verifies_halves_the_bytes_and_matches_bf16(
    extracted_workdir, tmp_path
):
    """`snakemake extract` on the small embedded default with fp8 storage, next to the shared
    bf16 run (the same token shards: a copy of its working directory)."""
    import re

    from eagleflow.data.shards import read_token_shard
    from support.workflow_runner import SMALL, copy_workdir, hidden_dir, merged, snakemake

    bf16_dir = hidden_dir(extracted_workdir)
    work = copy_workdir(extracted_workdir, tmp_path / "fp8")
    snakemake(work, "extract", config=merged(SMALL, {"capture": {"storage_dtype": FP8}}))
    (fp8_dir,) = [
        p
        for p in (work / "results" / "hidden").iterdir()
        if re.fullmatch("[0-9a-f]{16}", p.name) and p.name != bf16_dir.name
    ]
    plan = CapturePlan.load(fp8_dir / "capture_plan.json")
    assert plan.storage_dtype == FP8
    summary = pd.read_csv(fp8_dir / "verify_summary.tsv", sep="\t")
    assert len(summary) >= 4 and summary["ok"].all()
    sizes = {"bf16": 0, "fp8": 0}
    rels, coss = [], []
    for shard_id in summary["shard_id"]:
        tokens = read_token_shard(
            work / "results" / "shards" / "tokens" / f"{shard_id}.safetensors"
        )
        path = fp8_dir / f"{shard_id}.safetensors"
        record = json.loads((fp8_dir / f"{shard_id}.json").read_text())
        assert record["storage_dtype"] == FP8
        result = verify_shard(path, tokens, record, Expected.of(plan, "bfloat16"), deep=True)
        assert result["ok"], result["problems"]
        sizes["fp8"] += path.stat().st_size
        sizes["bf16"] += (bf16_dir / f"{shard_id}.safetensors").stat().st_size
        with safe_open(str(bf16_dir / f"{shard_id}.safetensors"), "pt") as a:
            ref = read_states(a, bf16_dir / f"{shard_id}.safetensors")
        with safe_open(str(path), "pt") as b:
            got = read_states(b, path)
        rel, cos = row_errors(ref, got)  # [T, n_layers]
        rels.append(rel)
        coss.append(cos)
    rel, cos = torch.cat(rels), torch.cat(coss)
    ratio = sizes["fp8"] / sizes["bf16"]
    print(
        f"fp8/bf16 bytes {ratio:.4f} ({sizes['fp8']} / {sizes['bf16']}); "
        f"rel err median {float(rel.median()):.4f} p95 {float(rel.quantile(0.95)):.4f}; "
        f"cosine median {float(cos.median()):.6f} min {float(cos.min()):.6f}; per layer id "
        + ", ".join(
            f"{k}: rel {float(rel[:, j].median()):.4f} cos {float(cos[:, j].median()):.6f}"
            for j, k in enumerate(plan.layer_ids)
        )
    )
    assert ratio <= 0.55
    assert float(cos.median()) >= 0.999 and float(rel.median()) <= 0.05
