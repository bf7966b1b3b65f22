"""scripts/contention.py (docs/performance.md's `contention` line): a bench run that fails says why, and a
count of rounds that would measure nothing is refused, each in one line rather than a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def contention(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "contention.py"), "--model", "minfer-tiny", *flags],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_failing_bench_run_says_why():
    result = contention("--", "--dtype", "nonsense")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("contention.py: bench.py exited with 2: python bench.py: error: --dtype ")


@pytest.mark.parametrize("flag", ["--rounds", "--busy"])
def test_no_rounds_or_no_busy_process_is_refused(flag):
    result = contention(flag, "0")
    assert result.returncode == 2 and f"argument {flag}: must be >= 1, got 0" in result.stderr, result.stderr
