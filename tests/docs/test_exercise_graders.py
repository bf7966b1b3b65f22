"""An exercise's grader fails a wrong answer: each case plugs minfer's own code with one requirement of the
stub's docstring broken into its stage (on a copy of tutorials/), and the stage's asserts must stop it.
test_tutorials.py shows the graders pass minfer's own code and stop at an unfilled stub; this is the third
side, a grader that passes whatever runs without crashing."""

import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minfer.engine.block_allocator import BlockAllocator
from minfer.engine.continuous_batcher import ContinuousBatcher
from minfer.server.manager import SchedulerManager

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
IMPORTS = """\
from __future__ import annotations

from minfer.attention.kv_cache import cdiv
from minfer.engine.block_allocator import block_hash
from minfer.engine.sequence import ScheduledChunk, Status
from minfer.server.manager import log
"""
# stage: (stage script, stub module, {stub function: minfer's own}, the function broken, (its line, broken))
WRONG_ANSWERS = {
    "07 allocate keeps a reused block's cached prefix": (
        "07_block_allocator", "ex07_block_allocator",
        {"allocate": BlockAllocator.allocate, "free": BlockAllocator.free},
        "allocate", ("if block.hash is not None:  # evict", "if False:  # evict"),
    ),
    "07 free keeps a twin's hash": (
        "07_block_allocator", "ex07_block_allocator",
        {"allocate": BlockAllocator.allocate, "free": BlockAllocator.free},
        "free", ("if block.hash is not None and self.cached.get(block.hash) != b:", "if False:"),
    ),
    "09 match_prefix trusts a hash without the tokens": (
        "09_prefix_caching", "ex09_prefix_caching",
        {"register_full_blocks": BlockAllocator.register_full_blocks, "match_prefix": BlockAllocator.match_prefix},
        "match_prefix", ("if block_id is None or self.blocks[block_id].token_ids != chunk:", "if block_id is None:"),
    ),
    "10 preempt puts the request at the back of the queue": (
        "10_online_scheduler", "ex10_scheduler",
        {"admit": ContinuousBatcher._admit, "preempt": ContinuousBatcher._preempt},
        "preempt", ("self.waiting.appendleft(seq)", "self.waiting.append(seq)"),
    ),
    "11 run tells a shutdown from a crash the wrong way round": (
        "11_scheduler_manager", "ex11_worker_loop", {"run": SchedulerManager._run},
        "run", ('"the engine has stopped" if self._dead else', '"the engine has stopped" if not self._dead else'),
    ),
}


def wrong_answer(functions: dict, broken: str, line: tuple[str, str]) -> str:
    """A stub module of minfer's own functions under the stub's names, with one line of `broken` changed."""
    parts = [IMPORTS]
    for name, function in functions.items():
        source = textwrap.dedent(inspect.getsource(function))
        source = source.replace(f"def {function.__name__}(", f"def {name}(", 1)
        if name == broken:
            assert line[0] in source, f"{function.__qualname__} no longer has {line[0]!r}: update this case"
            source = source.replace(line[0], line[1])
        parts.append(source)
    return "\n\n".join(parts)


@pytest.mark.parametrize("case", WRONG_ANSWERS)
def test_grader_fails_a_wrong_answer(case, tmp_path):
    stage, module, functions, broken, line = WRONG_ANSWERS[case]
    copy = tmp_path / "tutorials"
    shutil.copytree(TUTORIALS, copy, ignore=shutil.ignore_patterns("figures", "__pycache__", "*.md"))
    (copy / "exercises" / f"{module}.py").write_text(wrong_answer(functions, broken, line), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINFER_MODEL": "minfer-tiny", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(TUTORIALS.parent)}
    done = subprocess.run([sys.executable, f"{stage}.py", "--exercise"], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "AssertionError" in done.stderr, (
        f"{stage}.py --exercise passed a wrong answer ({case}): its asserts grade nothing of it\n"
        f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    )
    assert "graded" not in done.stdout
