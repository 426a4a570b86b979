"""The workflow passes Snakemake's own linter and snakefmt (as the snakemake-workflows catalog
asks), and the Python code ruff's lint and format checks (configured in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_snakemake_lint_reports_nothing():
    proc = subprocess.run(
        [str(BIN / "snakemake"), "--lint"], cwd=REPO, capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Congratulations" in out, out


def test_snakefmt_check_passes():
    files = [
        str(REPO / "Snakefile"),
        *map(str, sorted((REPO / "workflow" / "rules").glob("*.smk"))),
    ]
    proc = subprocess.run(
        [str(BIN / "snakefmt"), "--check", *files], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_check_passes():
    proc = subprocess.run(
        [str(BIN / "ruff"), "check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_check_passes():
    proc = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
