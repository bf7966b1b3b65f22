"""Timings that hold on a shared machine: variants interleaved, repeated, reported as median and spread,
and a chapter's claim ("X is faster than Y") checked against the medians, with a note when it fails.

Why interleave: on a busy CPU the load changes from one second to the next. Timing variant A five
times and then B five times compares two different moments; taking turns, A B A B ..., lets each
round see the same load. The median ignores a round that another process disturbed, and the spread
(the fastest and slowest round) shows how much the machine moved. A tutorial never fails on a timing:
when the medians contradict the chapter, it says so and why that can happen, and goes on.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Timing:
    seconds: list[float]  # one per round

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def __str__(self) -> str:
        ms = [1e3 * s for s in self.seconds]
        return f"{1e3 * self.median:8.2f} ms  (median of {len(ms)}; {min(ms):.2f} to {max(ms):.2f})"


def interleaved(variants: dict[str, Callable[[], object]], rounds: int = 7, warmup: int = 1) -> dict[str, Timing]:
    """Time each variant once per round, taking turns (the order rotated every round, so no variant is
    always first after a pause). `warmup` untimed rounds first pay for one-time allocations."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            variants[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: Timing(samples[name]) for name in names}


def show(timings: dict[str, Timing], width: int = 46, indent: str = "  ") -> None:
    for name, timing in timings.items():
        print(f"{indent}{name:<{width}}{timing}")


def claim(
    timings: dict[str, Timing], faster: str, slower: str, said: str, why: str, indent: str = "  ", factor: float = 1.0
) -> bool:
    """The chapter says `faster` takes less time than `slower` (or than `factor` times it), `said` in its
    words. Compare the medians and print whether they agree; if not, a note saying so and `why` it can
    happen. Returns whether the claim held; never raises."""
    fast, slow = timings[faster].median, timings[slower].median
    if fast < factor * slow:
        ratio = f"{slow / fast:.1f}x faster" if factor == 1 else f"{fast / slow:.1f}x the time"
        print(f"{indent}as the chapter says, {said}: {ratio} by the medians")
        return True
    print(
        f"{indent}NOTE: the chapter says {said}, but on this machine, now, the medians say otherwise "
        f"({1e3 * fast:.2f} ms against {1e3 * slow:.2f} ms). {why} The run goes on: timings are shown, never asserted."
    )
    return False


BUSY_MACHINE = (
    "Other processes sharing these cores, a CPU changing its clock, or caches another program keeps "
    "filling all move a timing by more than the difference measured here."
)
