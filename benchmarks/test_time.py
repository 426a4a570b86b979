"""Where the test suite's time goes, and a guard against it growing: reads the log of a run
with `--durations=0` (pytest's per-phase durations and its last line), prints the time per
test (setup + call + teardown) and per file, and fails when the run took more than the budget.

Run by hand on the reference machine (2 cores), never as a timed test:

  .venv/bin/python -m pytest --durations=0 2>&1 | tee /tmp/suite.log
  .venv/bin/python benchmarks/test_time.py /tmp/suite.log [--budget-min 20] [--top 40]
  .venv/bin/python benchmarks/test_time.py /tmp/after.log --before /tmp/before.log

`--before`: the slowest tests of both runs side by side, and each run's total. The budget and
the figures it guards are recorded in docs/measurements/test-suite.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import pandas as pd

DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)$")
# pytest's last line: "== 392 passed, 1 skipped in 3120.55s (0:52:00) =="
FINAL = re.compile(r"^=*\s*(\d+ \w+.*) in ([\d.]+)s")
PHASES = ("setup", "call", "teardown")


def read_log(path: Path) -> tuple[pd.DataFrame, float, str]:
    """(one row per test: file, test, setup/call/teardown seconds, total), the run's seconds
    as pytest reports them, and its outcome counts."""
    phases: dict[str, dict[str, float]] = defaultdict(dict)
    total, outcome = None, ""
    for line in path.read_text(errors="replace").splitlines():
        m = DURATION.match(line.strip())
        if m:
            seconds, phase, test = float(m[1]), m[2], m[3]
            phases[test][phase] = phases[test].get(phase, 0.0) + seconds
            continue
        m = FINAL.search(line)
        if m:
            outcome, total = m[1], float(m[2])
    if total is None:
        sys.exit(f"{path}: no pytest summary line ('... in N.NNs'): not a finished run's log")
    if not phases:
        sys.exit(f"{path}: no durations: run pytest with --durations=0")
    rows = [
        {"test": t, "file": t.split("::")[0], **{k: p.get(k, 0.0) for k in PHASES}}
        for t, p in phases.items()
    ]
    table = pd.DataFrame(rows)
    table["total"] = table[list(PHASES)].sum(axis=1)
    return table.sort_values("total", ascending=False, ignore_index=True), total, outcome


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", type=Path, help="a pytest log with --durations=0")
    p.add_argument("--budget-min", type=float, default=20.0, help="fail above this (minutes)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--before", type=Path, help="an earlier run's log: slowest tests side by side")
    a = p.parse_args(argv)
    table, total, outcome = read_log(a.log)
    pd.set_option("display.width", 200, "display.max_colwidth", 110, "display.max_rows", 500)
    print(f"{a.log}: {outcome}; {total:.0f} s ({total / 60:.1f} min)")
    print(f"\nslowest {a.top} tests (s):")
    print(table.head(a.top)[["total", "setup", "call", "test"]].round(1).to_string(index=False))
    files = table.groupby("file")["total"].agg(["sum", "count"]).sort_values("sum", ascending=False)
    print("\nper file (s):")
    print(files.round(1).to_string())
    if a.before is not None:
        before, before_total, before_outcome = read_log(a.before)
        side = pd.DataFrame(
            {
                "before_s": before["total"].head(20).round(1),
                "before": before["test"].head(20),
                "after_s": table["total"].head(20).round(1),
                "after": table["test"].head(20),
            }
        )
        print(f"\nslowest 20, before ({before_outcome}; {before_total:.0f} s) and after:")
        print(side.to_string(index=False))
    budget = a.budget_min * 60
    if total > budget:
        print(f"\nOVER BUDGET: {total:.0f} s > {budget:.0f} s ({a.budget_min:g} min)")
        return 1
    print(f"\nwithin budget: {total:.0f} s <= {budget:.0f} s ({a.budget_min:g} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
