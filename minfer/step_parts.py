"""Names for the parts of an engine step, so `bench.py --profile` can say where the time goes.

The engine marks each part it runs (`with part("context read"): ...`). That costs one check unless a
profiler has installed a timer (bench/step_timing.py), which adds up each part's wall time.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

timer: Callable[[str, bool], ContextManager] | None = None  # installed while profiling
_NONE = nullcontext()


def part(name: str, whole: bool = False):
    """A context manager marking one part of a step. A `whole` part keeps the time of the parts inside
    it: a draft model's attention is speculation's time, not attention's."""
    return _NONE if timer is None else timer(name, whole)
