"""The workflow passes Snakemake's own linter and snakefmt (as the snakemake-workflows catalog
asks), and the Python code ruff's lint and format checks (configured in pyproject.toml)."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_snakemake_lint_reports_nothing():
    proc = subprocess.run(
        [str(BIN / "snakemake"), "--lint"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Congratulations" in out, out


def test_snakefmt_check_passes():
    files = [
        str(REPO / "Snakefile"),
        *map(str, sorted((REPO / "workflow" / "rules").glob("*.smk"))),
    ]
    proc = subprocess.run(
        [str(BIN / "snakefmt"), "--check", *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_check_passes():
    proc = subprocess.run(
        [str(BIN / "ruff"), "check", "."], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_check_passes():
    proc = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def unbounded_waits(source: str, name: str) -> list[str]:
    """Calls in `source` that can wait forever: subprocess.run/call/check_* without `timeout=`,
    and `.communicate()`, `.wait()`, `.join()` with neither a timeout argument nor keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        call, owner = node.func.attr, node.func.value
        timed = "timeout" in {k.arg for k in node.keywords}
        runs = isinstance(owner, ast.Name) and owner.id == "subprocess"
        if runs and call in ("run", "call", "check_call", "check_output") and not timed:
            found.append(f"{name}:{node.lineno}: subprocess.{call}")
        elif call in ("communicate", "wait", "join") and not node.args and not timed:
            found.append(f"{name}:{node.lineno}: .{call}()")
    return found


def test_no_wait_in_the_suite_can_hang():
    """A hung job fails its test by timeout instead of running CI to its limit; an assert's
    message is evaluated when it fails, so it must not wait either."""
    bad = "import subprocess\nsubprocess.run(['x'])\np.communicate()\np.wait(5)\nt.join()\n"
    assert unbounded_waits(bad, "probe") == [
        "probe:2: subprocess.run",
        "probe:3: .communicate()",
        "probe:5: .join()",
    ]
    files = sorted((REPO / "tests").rglob("*.py"))
    found = [w for f in files for w in unbounded_waits(f.read_text(), str(f.relative_to(REPO)))]
    assert found == []
