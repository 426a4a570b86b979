import json
import shutil

import pytest
import torch
from safetensors import safe_open

from eagleflow.store.headers import read_header
from eagleflow.store.verify import (
    Expected,
    ShardInvalid,
    cheap_check,
    verify_extracted_shard,
    verify_shard,
)
from support.synthetic import FP, PLAN, make_extracted_shard, make_token_shards


@pytest.fixture
def extracted(tokenizer, tmp_path):
    shard = make_token_shards(tokenizer)[0]
    tokens, out, record = make_extracted_shard(shard, tmp_path)
    return shard, out, record


def run(shard, out, record, deep=False, fp=FP):
    return verify_shard(
        out, shard, record, Expected(fp, PLAN.layer_ids, PLAN.hidden_size, "bfloat16"), deep=deep
    )


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_a_good_shard_passes_and_reads_back(extracted):
    shard, out, record = extracted
    result = run(shard, out, record, deep=True)
    assert result["ok"], result["problems"]
    with safe_open(str(out), framework="pt") as f:
        assert f.get_tensor("hidden_states").shape == (len(shard.input_ids), 4, 16)
        assert f.metadata()["layer_ids"] == "[2, 4, 5, 8]"
        assert f.metadata()["layer_id_convention"] == "vllm"


def test_flipped_tensor_byte_is_caught_by_the_deep_check(extracted):
    shard, out, record = extracted
    _, data_start = read_header(out)
    flip_byte(out, data_start + 1001)
    assert run(shard, out, record)["ok"]  # same size, same header: only a re-hash sees it
    problems = run(shard, out, record, deep=True)["problems"]
    assert any("sha256" in p for p in problems)


def test_truncated_file_is_caught_by_the_cheap_check(extracted):
    shard, out, record = extracted
    with open(out, "r+b") as f:
        f.truncate(out.stat().st_size - 100)
    problems = cheap_check(out, record, FP)
    assert any("truncated" in p for p in problems)


def test_file_from_another_fingerprint_is_named(tokenizer, tmp_path, extracted):
    shard, out, record = extracted
    _, other, _ = make_extracted_shard(shard, tmp_path / "other", fp="fedcba9876543210")
    shutil.copy(other, out)
    record = {**record, "bytes": out.stat().st_size}
    assert any("another configuration" in p for p in cheap_check(out, record, FP))


def test_input_ids_not_matching_the_manifest_are_named(extracted):
    shard, out, record = extracted
    ids = shard.input_ids.copy()
    ids[7] += 1
    # Same shard id and sample ids, one token different: a stale or mixed-up file.
    forged = type(shard)(shard.shard_id, shard.sample_ids, ids, shard.loss_mask, shard.offsets)
    assert run(forged, out, record)["problems"] == [
        "input_ids differ from the tokenized shard's tokens"
    ]


def test_non_finite_and_zero_rows_are_named(tokenizer, tmp_path):
    shard = make_token_shards(tokenizer)[0]
    _, out, record = make_extracted_shard(shard, tmp_path)
    header, start = read_header(out)
    # Overwrite token 3, layer 0 with NaN (bf16 0x7fc0), then token 5 layer 1 with zeros.
    row_bytes = 4 * 16 * 2
    with open(out, "r+b") as f:
        f.seek(start + 3 * row_bytes)
        f.write(b"\xc0\x7f" * 16)
    problems = run(shard, out, {**record, "bytes": out.stat().st_size})["problems"]
    assert problems == ["hidden_states: non-finite value at token 3, layer id 2"]
    _, out, record = make_extracted_shard(shard, tmp_path / "b")
    with open(out, "r+b") as f:
        f.seek(start + 5 * row_bytes + 16 * 2)
        f.write(b"\x00\x00" * 16)
    assert run(shard, out, record)["problems"] == [
        "hidden_states: all-zero row at token 5, layer id 4"
    ]


def test_the_extract_jobs_verification_writes_the_report_last_or_quarantines(tokenizer, tmp_path):
    shard = make_token_shards(tokenizer)[0]
    _, out, record = make_extracted_shard(shard, tmp_path, keep_partial=True)
    report = out.with_name(f"{shard.shard_id}.verify.json")
    result = verify_extracted_shard(
        out, shard, record, Expected(FP, PLAN.layer_ids, PLAN.hidden_size, "bfloat16"), report
    )
    assert result["ok"] and json.loads(report.read_text()) == result
    report.unlink()
    # A shard that fails (here: a NaN row) is moved aside with its record; no report is written.
    _, start = read_header(out)
    with open(out, "r+b") as f:
        f.seek(start)
        f.write(b"\xc0\x7f" * 16)
    # Its partial directory (the file's data and chunk markers) goes too: the next run starts
    # afresh.
    partial = out.parent / ".partial" / shard.shard_id
    assert any(partial.iterdir())
    with pytest.raises(
        ShardInvalid, match=f"shard {shard.shard_id} .*non-finite value at token 0.*quarantine"
    ):
        verify_extracted_shard(
            out,
            shard,
            record,
            Expected(FP, PLAN.layer_ids, PLAN.hidden_size, "bfloat16"),
            report,
            partial_dir=partial,
        )
    assert (
        not out.exists()
        and not report.exists()
        and not out.with_suffix(".json").exists()
        and not partial.exists()
    )
    (moved,) = (out.parent / "quarantine").iterdir()
    assert (moved / out.name).is_file() and "non-finite" in (moved / "reason.txt").read_text()
    assert any((moved / "chunks").iterdir())


def test_wrong_layer_ids_are_named(extracted):
    shard, out, record = extracted
    problems = verify_shard(out, shard, record, Expected(FP, [2, 4, 5, 7], 16, "bfloat16"))[
        "problems"
    ]
    assert any("layer_ids [2, 4, 5, 8] in the file, expected [2, 4, 5, 7]" in p for p in problems)


def test_streaming_writer_matches_the_library_reader(extracted):
    shard, out, _ = extracted
    with safe_open(str(out), framework="pt") as f:
        assert torch.equal(f.get_tensor("offsets"), torch.from_numpy(shard.offsets))
        assert torch.equal(f.get_tensor("loss_mask"), torch.from_numpy(shard.loss_mask))
