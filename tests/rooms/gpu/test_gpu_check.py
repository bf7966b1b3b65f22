"""scripts/gpu_check.sh, the whole GPU check in one device call, runs here as a dry run (MINFER_DEVICE=cpu: tiny
shapes, flex traced as it serves, CUDA-only steps SKIP): its table has every step and no FAIL. Not its time:
that is the GPU's."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STEPS = ["env", "flex", "engines", "tests", "qwen3"]


def test_the_dry_run_has_no_fail(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINFER_")}  # not the tests' defaults
    env |= {"MINFER_DEVICE": "cpu", "MINFER_NUM_THREADS": os.environ.get("MINFER_NUM_THREADS", "1"),
            "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    table = (tmp_path / "table.txt").read_text()
    print(table)  # the dry run's table, in the test's output
    rows = [line.split(maxsplit=2) for line in table.splitlines()[2:]]
    assert [row[0] for row in rows] == STEPS, table
    assert [row[0] for row in rows if row[1] == "FAIL"] == [], done.stdout[-4000:]
    assert {row[0]: row[1] for row in rows}["tests"] == "SKIP" and done.returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "01_env.log", "02_flex.log", "03_engines.log", "04_tests.log", "05_qwen3.log", "table.txt"
    ]  # at most 8 files come back from the device machine
