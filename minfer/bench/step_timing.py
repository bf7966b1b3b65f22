"""The step-part timer bench.py's profile installs: each part the engine marks (step_parts.part) adds
its wall time to a running total. Plain timers, not torch.profiler: the profiler's own cost per
recorded op (tens of microseconds) inflated the parts made of many small ops several-fold."""

from __future__ import annotations

from collections import defaultdict
from time import perf_counter
from typing import Callable

from .. import step_parts

# The parts the engine labels, in step order. bench/profile.py times the linears and the
# LM head by hooks on their modules; what no part covers is the small ops in between
# (layer norms, GELU, residual adds, embeddings) and Python between ops.
PARTS = (
    "host: schedule",
    "speculation: propose",  # inside the schedule (a part inside another counts for itself alone)
    "host: prepare",
    "KV write",
    "context read",
    "attention",
    "sampling",
    "speculation: verify",  # inside sampling
    "host: bookkeeping",
)

_totals: dict[str, float] | None = None  # seconds per part while timing, else None
_sync: Callable[[], None] | None = None  # on a GPU, wait for queued kernels at each boundary
_open: list[_Timer] = []  # the parts being timed, innermost last


class _Timer:
    __slots__ = ("name", "start", "whole")

    def __init__(self, name: str, whole: bool = False):
        self.name = name
        self.whole = whole

    def __enter__(self):
        if _sync is not None:
            _sync()
        self.start = perf_counter()
        _open.append(self)

    def __exit__(self, *exc):
        if _sync is not None:
            _sync()
        _open.remove(self)
        if _totals is not None and not any(t.whole for t in _open):  # inside a whole part: its time
            seconds = perf_counter() - self.start
            _totals[self.name] += seconds
            if _open:  # a part inside another: its time is its own, not the enclosing part's too
                _totals[_open[-1].name] -= seconds


def start_timing(sync: Callable[[], None] | None = None) -> dict[str, float]:
    """Start adding up each part's seconds; returns the totals, filled in as steps run."""
    global _totals, _sync
    _totals, _sync = defaultdict(float), sync
    step_parts.timer = _Timer
    return _totals


def stop_timing() -> None:
    global _totals, _sync
    step_parts.timer = None
    _totals, _sync = None, None
