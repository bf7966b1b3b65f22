"""How torch's OpenMP threads wait for work, as the start-up banner and bench.py's header report it.

On Linux, torch runs its parallel loops on GNU OpenMP (libgomp). Between two parallel regions an
idle thread spins for a while before it sleeps (GOMP_SPINCOUNT rounds, 300,000 by default), so
the next region starts without a wake-up. Beside a busy process that spin is ruinous: a decode step
is hundreds of short regions, each ending at a barrier, and a thread spinning there holds a core the
thread it waits for needs (7x slower on 2 cores). minfer leaves the spin alone and has CpuShare
(thread_share.py) drop the thread that would wait instead: beside a busy process that kept 0.63x of
the quiet speed, against 0.37-0.40x with a 10,000-round spin, and the quiet speed is untouched,
where the shorter spin cost ~6% (scripts/contention.py, 2-core Zen 4). So libgomp's default stands
unless the user sets OMP_WAIT_POLICY or GOMP_SPINCOUNT.
"""

from __future__ import annotations

from .. import settings


def wait_policy() -> str:
    """A phrase for the start-up banner: how OpenMP threads wait, and who chose it."""
    chosen = [f"{var.name}={var.get()}" for var in (settings.OMP_WAIT_POLICY, settings.GOMP_SPINCOUNT) if var.is_set]
    if chosen:
        return f"{', '.join(chosen)} (from the environment)"
    return "libgomp's default spin (set GOMP_SPINCOUNT or OMP_WAIT_POLICY to change it)"
