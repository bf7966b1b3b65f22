"""How many threads torch starts with: the user's count (--num-threads, MINFER_NUM_THREADS,
OMP_NUM_THREADS), else every core this process may use, or as many as a container's CPU quota
(cgroup.py) holds whole CPUs, if fewer. thread_share.py lowers it while other processes compete
for those cores."""

from __future__ import annotations

import os

from .. import settings
from ..errors import whole_number
from .cgroup import cpu_quota

THREAD_ENV_VARS = (settings.NUM_THREADS, settings.OMP_NUM_THREADS)  # the user's thread count, in this order


def threads_chosen(num_threads: int | None) -> bool:
    """Whether the user fixed the thread count (the --num-threads flag or an environment variable)."""
    return num_threads is not None or any(var.is_set for var in THREAD_ENV_VARS)


def cpu_threads_wanted(num_threads: int | None = None) -> int:
    """The thread count set_cpu_threads gives torch (threads_and_origin)."""
    return threads_and_origin(num_threads)[0]


def threads_and_origin(num_threads: int | None = None) -> tuple[int, str]:
    """The thread count set_cpu_threads gives torch, and where it came from, for the banner: num_threads (the
    --num-threads flag), else MINFER_NUM_THREADS, else OMP_NUM_THREADS (a container's OMP_NUM_THREADS=1, say),
    else one per core, or the whole CPUs of a CPU quota (cgroup.py) that holds fewer."""
    if num_threads is not None:
        return num_threads, "--num-threads"
    for var in THREAD_ENV_VARS:
        value = var.get()
        if value is not None:
            count = whole_number(value)
            if not count:
                raise ValueError(f"{var.name} must be a positive integer, got {value!r}")
            return count, f"{var.name}={value}"
    cores, quota = len(cores_allowed()), cpu_quota()
    if quota is None or quota >= cores:
        return cores, "one per core"
    return max(1, int(quota)), f"a CPU quota of {quota:g}"


def cores_allowed() -> list[int]:
    """The cores this process may run on (Linux: its affinity; elsewhere every core). Where OpenMP binds
    threads, an affinity narrower than minfer found on import is its binding of this thread, not the
    user's choice of cores (settings.CPUS_AT_IMPORT): the cores from before count. (Without that,
    OMP_PROC_BIND=true ran GPT-2 batch 1 on one thread of two: 42.4 ms/token against 22.8.)"""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return list(range(os.cpu_count() or 1))
    now, at_import = affinity(0), settings.CPUS_AT_IMPORT
    return sorted(at_import if at_import and now < at_import and openmp_binds() else now)


def bound_before_minfer() -> bool:
    """Whether OpenMP bound this thread to one core of several before minfer could note the process's CPUs
    (torch was imported first): cores_allowed() then says one core, and set_cpu_threads warns."""
    return settings.CPUS_AT_IMPORT is None and openmp_binds() and len(cores_allowed()) == 1 < (os.cpu_count() or 1)


def openmp_binds() -> bool:
    """Whether libgomp was told to bind its threads to CPUs: OMP_PROC_BIND other than false, or a list of
    CPUs to bind to (OMP_PLACES, GOMP_CPU_AFFINITY) that OMP_PROC_BIND=false does not switch off."""
    bind = (settings.OMP_PROC_BIND.get() or "").lower()
    return bind != "false" and (bind != "" or settings.OMP_PLACES.is_set or settings.GOMP_CPU_AFFINITY.is_set)
