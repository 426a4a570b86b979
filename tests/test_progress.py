"""`snakemake progress` (what extraction has left to do) in a fresh directory: it shards first,
then reads the target (the embedded one is built on the way), and loads no model."""

from support.workflow_runner import SMALL, snakemake


def test_progress_in_a_fresh_directory(tmp_path):
    snakemake(tmp_path, "progress", config=SMALL)
    report = (tmp_path / "results" / "logs" / "progress.log").read_text()
    assert "shards: 4 total, 0 done, 4 to do" in report, report
    assert "estimated time: unknown until a shard has been extracted" in report
