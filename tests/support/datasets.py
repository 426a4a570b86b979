"""Small datasets written for a test: JSONL rows, and prompt-only rows for regeneration."""

import json
from pathlib import Path


def write_jsonl(path: Path, rows) -> Path:
    """`rows` (dicts, or lines already encoded) as a JSONL file at `path`."""
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def rows_of(n: int, start: int = 0) -> list[dict]:
    """`n` prompt-only rows (one user turn each, ids q<start> on), as regeneration reads them."""
    return [{"id": f"q{i}", "turns": [f"Question number {i}?"]} for i in range(start, start + n)]
