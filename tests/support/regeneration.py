"""What the tests of regeneration without vLLM share: a target identity and a shard's files."""

from pathlib import Path

from eagleflow.regenerate.shard import ShardFiles
from eagleflow.regenerate.sources import regeneration_identity

# A fake target's identity with fixed settings: the source shard ids depend on it.
IDENTITY = regeneration_identity({"config.json": "a fake target"}, 8, 512, True)


def shard_files(out: Path, shard_id: str) -> ShardFiles:
    """The files a regenerate_shard job writes for `shard_id` in `out`."""
    return ShardFiles(
        out / f"{shard_id}.jsonl",
        out / f"{shard_id}.rejects.jsonl",
        out / f"{shard_id}.summary.json",
    )
