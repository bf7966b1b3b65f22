"""How torch's OpenMP threads wait for work, chosen before torch loads.

On Linux, torch runs its parallel loops on GNU OpenMP (libgomp). Between two parallel regions an
idle thread spins for a while before it sleeps (GOMP_SPINCOUNT rounds, 300,000 by default), so
the next region starts without a wake-up. On a CPU minfer has to itself that is free. On a shared
one it is ruinous: a decode step is hundreds of short regions, each ends at a barrier, and a
thread spinning there holds a core that the thread it waits for, descheduled by a neighbour's
process, needs. One busy process beside minfer on 2 cores made it 7x slower.

So minfer shortens the spin (SPIN_COUNT below), unless the user chose: OMP_WAIT_POLICY or
GOMP_SPINCOUNT set in the environment win. Measured with scripts/contention.py on a 2-core Zen 4:
beside one busy process 0.32x of the quiet speed before, 0.37-0.40x with 10,000; quiet speed
within noise. A shorter spin helps the busy case more (3,000: 0.46x; 1,000: 0.59x) but costs a
quiet batch-1 decode 14% (3,000), since a sleeping thread must be woken for every region. libgomp reads them once, when torch loads, so this
module must run before the first `import torch`; minfer/__init__.py imports it first. A program
that imported torch before minfer keeps libgomp's default, and wait_policy() says so.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"  # rounds of spinning before an idle OpenMP thread sleeps (libgomp's default: 300,000)
_USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_set_by_minfer = False


def choose_wait_policy() -> None:
    """Shorten libgomp's spin-wait for this process and its children, if nobody chose and it is not
    too late (torch already loaded)."""
    global _set_by_minfer
    if "torch" in sys.modules or any(os.environ.get(name) for name in _USER_CHOICES):
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    _set_by_minfer = True


def wait_policy() -> str:
    """A phrase for the start-up banner: how OpenMP threads wait, and who chose it."""
    chosen = [f"{name}={os.environ[name]}" for name in _USER_CHOICES if os.environ.get(name)]
    if _set_by_minfer:
        return f"GOMP_SPINCOUNT={SPIN_COUNT} (minfer's choice for shared CPUs; set GOMP_SPINCOUNT or OMP_WAIT_POLICY to override)"
    if chosen:
        return f"{', '.join(chosen)} (from the environment)"
    return "libgomp's default spin (torch was imported before minfer, or not on Linux)"
