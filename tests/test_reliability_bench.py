"""The reliability benchmark runs end to end in its --quick mode and reports every case.

This checks the benchmark's machinery (servers up and down, each case run and judged, table and JSON
written, exit code agreeing with the verdicts), not the verdicts themselves: those are what the
benchmark reports, and each invariant behind them has its own tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess with its own S3 server: run by make test, skippable with -m "not slow"

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "reliability.py"


def test_the_quick_reliability_benchmark_judges_every_case_and_exits_accordingly(tmp_path):
    out = tmp_path / "reliability.json"
    done = subprocess.run([sys.executable, str(BENCHMARK), "--quick", "--out", str(out)], check=False,
                          capture_output=True, text=True, timeout=180)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert len(cases) >= 20 and all(c["expected"] and c["observed"] for c in cases)
    crashed = [c["case"] for c in cases if c["observed"].startswith("unexpected ")]
    assert not crashed, f"the benchmark itself broke in {crashed}"
    assert report["failed"] == [c["case"] for c in cases if not c["passed"]]
    assert done.returncode == (1 if report["failed"] else 0), done.stderr[-3000:]
    assert "| case | expected | observed | pass | seconds |" in done.stdout
    assert len([line for line in done.stdout.splitlines() if line.startswith("| ")]) == len(cases) + 2
