"""benchmarks/test_time.py, the guard of the suite's time budget, on a made-up log."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LOG = """tests/test_a.py ..                                                  [100%]
============================= slowest durations ==============================
300.00s setup    tests/test_a.py::test_slow
400.50s call     tests/test_a.py::test_slow
2.00s teardown tests/test_a.py::test_slow
10.00s call     tests/test_b.py::test_fast[x]
0.01s setup    tests/test_b.py::test_fast[x]
=================== 2 passed, 1 skipped in {total}s (0:00:00) ===================
"""


def run(tmp_path, total, *args):
    log = tmp_path / "suite.log"
    log.write_text(LOG.format(total=total))
    cmd = [sys.executable, str(REPO / "benchmarks" / "test_time.py"), str(log), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_run_within_the_budget_passes_and_sums_each_tests_phases(tmp_path):
    proc = run(tmp_path, "1190.00")
    assert proc.returncode == 0, proc.stderr
    assert "2 passed, 1 skipped; 1190 s (19.8 min)" in proc.stdout
    first = proc.stdout.split("slowest 40 tests (s):\n")[1].splitlines()[1]
    assert first.split() == ["702.5", "300.0", "400.5", "tests/test_a.py::test_slow"]
    assert "within budget" in proc.stdout


def test_a_run_over_the_budget_fails_naming_it(tmp_path):
    proc = run(tmp_path, "1300.00", "--budget-min", "20")
    assert proc.returncode == 1
    assert "OVER BUDGET: 1300 s > 1200 s (20 min)" in proc.stdout


def test_a_log_without_durations_is_refused(tmp_path):
    log = tmp_path / "plain.log"
    log.write_text("== 3 passed in 5.00s ==\n")
    cmd = [sys.executable, str(REPO / "benchmarks" / "test_time.py"), str(log)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--durations=0" in proc.stderr


def test_the_summary_line_of_a_quiet_run_is_read(tmp_path):
    """`pytest -q` prints its summary without the `=` rule around it."""
    log = tmp_path / "quiet.log"
    log.write_text(
        LOG.format(total="1190.00").replace("=" * 19 + " ", "").replace(" " + "=" * 19, "")
    )
    assert "\n2 passed, 1 skipped in 1190.00s" in log.read_text()
    cmd = [sys.executable, str(REPO / "benchmarks" / "test_time.py"), str(log)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2 passed, 1 skipped; 1190 s (19.8 min)" in proc.stdout
