"""How many threads torch should use while other processes compete for this process's cores.

A decode step is hundreds of short OpenMP regions, each ending at a barrier where every thread waits for the
slowest. With as many threads as cores and one busy process beside minfer, the kernel's scheduler keeps one
of minfer's threads off a core much of the time, and every region waits for it: on 2 cores minfer fell to a
seventh of its quiet speed. One thread fewer than the cores others leave free avoids the wait: that thread
always has a core.

So while the engine runs, `CpuShare.update()` measures, about twice a second, how much CPU time other
processes took on the cores this process may use (/proc/stat minus /proc/self/stat), and sets torch's thread
count to the cores left over (never fewer than one, never more than the count it started with). On a quiet
machine nothing changes. It runs only where /proc exists (Linux), and only when nobody chose the thread
count (--num-threads, MINFER_NUM_THREADS, OMP_NUM_THREADS). It runs on the engine's thread, between steps:
torch's thread count (OpenMP's) belongs to the thread that sets it. docs/performance.md has what it gains.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from .threads import cores_allowed, cpu_threads_wanted

INTERVAL_S = 0.5  # how often the share is measured; shorter windows are mostly noise
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(cores: list[int]) -> int | None:
    """Non-idle time of these cores since boot, in clock ticks (all processes, ours included)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cores}
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name in wanted:
            # user nice system idle iowait irq softirq steal ...: idle and iowait are free time
            values = [int(v) for v in fields[:8]]
            total += sum(values) - values[3] - values[4]
    return total


def _own_ticks() -> int | None:
    """This process's CPU time (user + system, every thread) in clock ticks."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))


class CpuShare:
    """Adjusts torch's thread count to the cores other processes leave free (see the module doc).
    `enabled=False` (threads fixed by the user) makes update() do nothing."""

    def __init__(self, enabled: bool = True, max_threads: int | None = None):
        self.cores = cores_allowed()
        self.max_threads = max_threads or cpu_threads_wanted()
        self.threads = torch.get_num_threads()  # an earlier engine in this process may have lowered it
        self.others = 0.0  # cores' worth of CPU other processes used in the last window
        self.changes = 0
        self._last = self._sample()
        self.enabled = enabled and self.max_threads > 1 and self._last is not None

    def _sample(self) -> tuple[float, int, int] | None:
        busy, own = _busy_ticks(self.cores), _own_ticks()
        return None if busy is None or own is None else (time.monotonic(), busy, own)

    def update(self) -> int:
        """Called before each engine step: re-measures at most every INTERVAL_S. Returns the threads."""
        if self.enabled and time.monotonic() - self._last[0] >= INTERVAL_S:
            self._measure()
        return self.threads

    def _measure(self) -> None:
        """Other processes' share of these cores since the last measure -> torch's thread count."""
        now = self._sample()
        if now is None:
            return
        elapsed_ticks = (now[0] - self._last[0]) * _TICKS_PER_S
        self.others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / elapsed_ticks
        self._last = now
        free = len(self.cores) - self.others
        wanted = min(self.max_threads, max(1, int(free + 0.5)))  # a competitor using half a core or more costs a thread
        if wanted != self.threads:
            torch.set_num_threads(wanted)
            self.threads = wanted
            self.changes += 1
