"""Every setting minfer reads from the environment, in one place.

Each variable is read when asked, not at import (tests and the command line change the environment
between calls), through the one `EnvVar` that names it; the modules that act on a setting import
it from here. `minfer settings` lists them with their current values.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str

    def get(self, default: str | None = None) -> str | None:
        """The variable's value, stripped; `default` where it is unset or empty."""
        value = os.environ.get(self.name, "").strip()
        return value or default

    @property
    def is_set(self) -> bool:
        return self.get() is not None


DEVICE = EnvVar("MINFER_DEVICE", "the default --device (the tests' way to run on a GPU); else cpu")
ATTENTION_BACKEND = EnvVar("MINFER_ATTENTION_BACKEND", "the default --attention-backend; else auto")
DTYPE = EnvVar("MINFER_DTYPE", "the default --dtype; else auto on a GPU, float32 on a CPU")
NUM_THREADS = EnvVar("MINFER_NUM_THREADS", "torch's CPU threads, unless --num-threads is given")
OMP_NUM_THREADS = EnvVar("OMP_NUM_THREADS", "OpenMP's thread count: torch's CPU threads after MINFER_NUM_THREADS")
API_KEY = EnvVar("MINFER_API_KEY", "the server's --api-key")
OMP_WAIT_POLICY = EnvVar("OMP_WAIT_POLICY", "how idle OpenMP threads wait (libgomp: ACTIVE or PASSIVE)")
GOMP_SPINCOUNT = EnvVar("GOMP_SPINCOUNT", "how long an idle libgomp thread spins before it sleeps")
OMP_PROC_BIND = EnvVar("OMP_PROC_BIND", "whether OpenMP binds its threads to CPUs (any value but false: it does)")
OMP_PLACES = EnvVar("OMP_PLACES", "the CPUs OpenMP binds its threads to (binding them, unless OMP_PROC_BIND=false)")
GOMP_CPU_AFFINITY = EnvVar("GOMP_CPU_AFFINITY", "libgomp's own list of CPUs to bind its threads to")
CACHE = EnvVar("MINFER_CACHE", "compiled graphs kept for the next start (off: none); default XDG_CACHE_HOME/minfer")
XDG_CACHE_HOME = EnvVar("XDG_CACHE_HOME", "the user's cache directory, Hugging Face's cache's too; else ~/.cache")

# Not a variable, but the process's environment too: the CPUs it may use, as this module found them on
# import. The package imports it before torch, whose OpenMP (libgomp), told to bind threads by OMP_PROC_BIND,
# OMP_PLACES or GOMP_CPU_AFFINITY, pins the importing thread to one of those CPUs as it loads: its affinity
# read later says one core (cpu/threads.py). None: torch came first, and may have bound it already.
CPUS_AT_IMPORT = None
if hasattr(os, "sched_getaffinity") and "torch" not in sys.modules:
    CPUS_AT_IMPORT = frozenset(os.sched_getaffinity(0))

ALL = (DEVICE, ATTENTION_BACKEND, DTYPE, NUM_THREADS, OMP_NUM_THREADS, API_KEY, OMP_WAIT_POLICY, GOMP_SPINCOUNT,
       OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY, CACHE, XDG_CACHE_HOME)
