import json

from eagleflow.integrity import check_finished_shards
from synthetic import FP, make_extracted_shard, make_token_shards


def test_damaged_shards_are_quarantined_with_their_reason(tokenizer, tmp_path):
    shards = make_token_shards(tokenizer, n=12, size=4)
    for shard in shards:
        make_extracted_shard(shard, tmp_path)
    d = tmp_path / FP
    good, truncated, no_record = (s.shard_id for s in shards)
    with open(d / f"{truncated}.safetensors", "r+b") as f:
        f.truncate(1000)
    (d / f"{no_record}.json").unlink()
    messages = []
    bad = check_finished_shards(d, [s.shard_id for s in shards] + ["f" * 20], FP, log=messages.append)
    assert bad == [truncated, no_record]
    assert (d / f"{good}.safetensors").exists()
    assert not (d / f"{truncated}.safetensors").exists() and not (d / f"{no_record}.safetensors").exists()
    reasons = {p.parent.name.split("-")[0]: p.read_text() for p in (d / "quarantine").glob("*/reason.txt")}
    assert "truncated" in reasons[truncated] and "record unreadable" in reasons[no_record]
    assert any(truncated in m for m in messages)
    # The quarantined files are kept, not deleted.
    assert len(list((d / "quarantine").glob(f"{truncated}-*/{truncated}.safetensors"))) == 1


def test_a_file_from_another_fingerprint_is_quarantined(tokenizer, tmp_path):
    shard = make_token_shards(tokenizer, n=4, size=4)[0]
    _, out, record = make_extracted_shard(shard, tmp_path, fp="fedcba9876543210")
    d = tmp_path / FP
    d.mkdir()
    out.rename(d / out.name)
    (d / f"{shard.shard_id}.json").write_text(json.dumps(record))
    assert check_finished_shards(d, [shard.shard_id], FP, log=lambda m: None) == [shard.shard_id]
