"""An exercise's grader fails a wrong answer: each case plugs minfer's own code with one requirement of the
stub's docstring broken into its stage (on a copy of tutorials/), and the stage's asserts must stop it.
test_tutorials.py shows the graders pass minfer's own code and stop at an unfilled stub; this is the third
side, a grader that passes whatever runs without crashing."""

import inspect
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from script_forks import run_python

from minfer.attention.torch_sdpa import TorchBackend
from minfer.engine.block_allocator import BlockAllocator
from minfer.engine.continuous_batcher import ContinuousBatcher
from minfer.server.manager import SchedulerManager

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
IMPORTS = """\
from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.attention.kv_cache import cdiv
from minfer.attention.torch_sdpa import gather_slots
from minfer.engine.block_allocator import block_hash
from minfer.engine.sequence import ScheduledChunk, Status
from minfer.server.manager import log
from minfer.step_parts import part
"""
ALLOCATE_FREE = {"allocate": BlockAllocator.allocate, "free": BlockAllocator.free}
PREFIX_INDEX = {"register_full_blocks": BlockAllocator.register_full_blocks,
                "match_prefix": BlockAllocator.match_prefix}
ADMIT_PREEMPT = {"admit": ContinuousBatcher._admit, "preempt": ContinuousBatcher._preempt}
CAPACITY_CHECK = "    if n > len(self.free_queue):\n        raise RuntimeError("
TAKE_ONE = "        b, _ = self.free_queue.popitem(last=False)"
DECODE_SDPA = "ks, vs, attn_mask=group.mask, scale=scale, enable_gqa=gqa)"
# Each K/V head tiled rather than repeated in place: query head h reads K/V head h % Hkv, not h // (H / Hkv).
TILED_HEADS = "*(t.repeat(1, q.shape[1] // t.shape[1], 1, 1) for t in (ks, vs)), attn_mask=group.mask, scale=scale)"
SKIP_HASHED = "    while first > 0 and blocks[block_table[first - 1]].hash is None:\n        first -= 1\n"
NO_WIND_DOWN_ON_CRASH = (("    finally:\n        with self._lock:", "    if True:\n        with self._lock:"),
                         ('{type(e).__name__}"', '{type(e).__name__}"\n        return'))
# case: (stage script, stub module, {stub function: minfer's own}, {stub function: ((its line, broken), ...)},
#        what the stage's failed assert must tell the learner).
# A stub function that a plugged one calls in place of a minfer method (forward's decode_attention) is listed too.
WRONG_ANSWERS = {
    "07 allocate keeps a reused block's cached prefix": (
        "07_block_allocator", "ex07_block_allocator", ALLOCATE_FREE,
        {"allocate": (("if block.hash is not None:  # evict", "if False:  # evict"),)},
        'allocate evicts what a reused block cached',
    ),
    "07 allocate takes blocks before it finds too few free": (
        "07_block_allocator", "ex07_block_allocator", ALLOCATE_FREE,
        {"allocate": ((CAPACITY_CHECK, "    if False:\n        raise RuntimeError("),
                      (TAKE_ONE, "        if not self.free_queue:\n            raise RuntimeError('out of blocks')\n"
                       + TAKE_ONE))},
        'a refused allocate takes no block',
    ),
    "07 free keeps a twin's hash": (
        "07_block_allocator", "ex07_block_allocator", ALLOCATE_FREE,
        {"free": (("if block.hash is not None and self.cached.get(block.hash) != b:", "if False:"),)},
        '(a twin) must forget its hash',
    ),
    "08 forward pairs query heads with the wrong key/value heads": (
        "08_paged_attention", "ex08_paged_attention",
        {"forward": TorchBackend.forward, "decode_attention": TorchBackend.decode_attention},
        {"forward": (("self.decode_attention(", "decode_attention(self, "),),
         "decode_attention": ((DECODE_SDPA, TILED_HEADS),)},
        '(4 query heads, 2 K/V heads): paged differs',
    ),
    "09 match_prefix trusts a hash without the tokens": (
        "09_prefix_caching", "ex09_prefix_caching", PREFIX_INDEX,
        {"match_prefix": (("if block_id is None or self.blocks[block_id].token_ids != chunk:",
                           "if block_id is None:"),)},
        'never trusts a hash alone',
    ),
    "09 match_prefix misses a last block that is full": (
        "09_prefix_caching", "ex09_prefix_caching", PREFIX_INDEX,
        {"match_prefix": (("len(token_ids) - block_size + 1", "len(token_ids) - block_size"),)},
        'the last one counts too',
    ),
    "09 register_full_blocks hashes every full block again": (
        "09_prefix_caching", "ex09_prefix_caching", PREFIX_INDEX,
        {"register_full_blocks": ((SKIP_HASHED, "    first = 0\n"),)},
        'renamed blocks it had named before',
    ),
    "09 register_full_blocks names blocks with prefix caching off": (
        "09_prefix_caching", "ex09_prefix_caching", PREFIX_INDEX,
        {"register_full_blocks": (("if not self.enable_prefix_caching:", "if False:"),)},
        'with prefix caching off, nothing is named',
    ),
    "10 admit reuses the block that holds the prompt's last token": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"admit": (("seq.token_ids[: seq.num_tokens - 1]", "seq.token_ids"),)},
        'a hit never covers the last token',
    ),
    "10 admit ignores max_cached_tokens": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"admit": (("if seq.max_cached_tokens is not None:", "if False:"),)},
        'with max_cached_tokens=6 the hit covered 8 tokens',
    ),
    "10 admit takes max_cached_tokens=0 for no cap": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"admit": (("if seq.max_cached_tokens is not None:", "if seq.max_cached_tokens:"),)},
        'max_cached_tokens=0 allows no hit',
    ),
    "10 admit leaves num_computed_tokens before the hit": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"admit": (("seq.num_computed_tokens = cached", "pass"),)},
        'admit sets num_computed_tokens',
    ),
    "10 admit does not count its hit": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"admit": (("self.prefix_cache_hit_tokens += cached", "pass"),)},
        "adds its hit to the batcher's count",
    ),
    "10 admit forgets that cached hits use up free blocks": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"admit": (("new_blocks + self.allocator.num_unreferenced(hits) >", "new_blocks >"),)},
        'use up free blocks too',
    ),
    "10 preempt puts the request at the back of the queue": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"preempt": (("self.waiting.appendleft(seq)", "self.waiting.append(seq)"),)},
        'goes to the front of the queue',
    ),
    "10 preempt leaves the sequence RUNNING": (
        "10_online_scheduler", "ex10_scheduler", ADMIT_PREEMPT,
        {"preempt": (("seq.status = Status.WAITING", "pass"),)},
        'a preempted sequence is WAITING',
    ),
    "11 run tells a shutdown from a crash the wrong way round": (
        "11_scheduler_manager", "ex11_worker_loop", {"run": SchedulerManager._run},
        {"run": (('"the engine has stopped" if self._dead else', '"the engine has stopped" if not self._dead else'),)},
        'a shutdown is not a crash',
    ),
    "11 run winds down only when asked to stop, not after a crash": (
        "11_scheduler_manager", "ex11_worker_loop", {"run": SchedulerManager._run}, {"run": NO_WIND_DOWN_ON_CRASH},
        'gets a 503 Error, not silence',
    ),
}


def wrong_answer(functions: dict, edits: dict[str, tuple]) -> str:
    """A stub module of minfer's own functions under the stub's names, with the lines `edits` names changed."""
    parts = [IMPORTS]
    for name, function in functions.items():
        source = textwrap.dedent(inspect.getsource(function))
        source = source.replace(f"def {function.__name__}(", f"def {name}(", 1)
        for line, broken in edits.get(name, ()):
            assert line in source, f"{function.__qualname__} no longer has {line!r}: update this case"
            source = source.replace(line, broken)
        parts.append(source)
    return "\n\n".join(parts)


@pytest.mark.parametrize("case", WRONG_ANSWERS)
def test_grader_fails_a_wrong_answer(case, tmp_path):
    stage, module, functions, edits, says = WRONG_ANSWERS[case]
    copy = tmp_path / "tutorials"
    shutil.copytree(TUTORIALS, copy, ignore=shutil.ignore_patterns("figures", "__pycache__", "*.md"))
    (copy / "exercises" / f"{module}.py").write_text(wrong_answer(functions, edits), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINFER_MODEL": "minfer-tiny"}
    done = run_python([sys.executable, f"{stage}.py", "--exercise"], cwd=copy, env=env, timeout=300)  # in a fork of
    # a process that has imported torch: most of a stage's run was importing it
    assert done.returncode != 0 and "AssertionError" in done.stderr, (
        f"{stage}.py --exercise passed a wrong answer ({case}): its asserts grade nothing of it\n"
        f"--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    )
    assert says in done.stderr, f"{stage}.py stopped {case!r}, but its message does not say what is wrong:\n" + (
        done.stderr[-3000:])
    assert "graded" not in done.stdout
