"""Every example runs as-is (each one checks its own result and exits non-zero if it is wrong)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses: run by make test, skippable with -m "not slow"

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["quickstart.py", "resume.py", "blend.py", "frozen_cache.py", "demo.py", "pretrain_packed.py",
                                  "pretrain_text.py"])
def test_example_runs(name):
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip()


def test_a_main_process_pass_exits_cleanly(tmp_path):
    """pyarrow reading through Python file objects can abort at exit once torch is imported
    (apache/arrow#34314); a pass in the main process must end with exit code 0."""
    script = (
        "import streamshard as ss\n"
        "from streamshard.testing import write_corpus\n"
        f"write_corpus({str(tmp_path)!r}, [[40, 30], [25]])\n"
        f"ds = ss.ParquetStream({str(tmp_path)!r}, shuffle=True, rank=0, world_size=1)\n"
        "print(sum(int((b['sample_id'] >= 0).sum()) for b in ds))\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "95"
