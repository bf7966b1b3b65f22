"""The CPU time a container may use: its cgroup's quota (`docker run --cpus 1.5`, a Kubernetes CPU limit).

The quota is not in the affinity: a 1-CPU container on a 2-core host sees both cores, and two OpenMP
threads then spend its quota twice as fast and wait, throttled, the rest of each period (GPT-2 batch 1
under a 1-CPU quota on 2 cores: 58.2 ms/token with 2 threads, 48.3 with 1). threads.py starts no more
threads than the quota's whole CPUs. Linux only; where nothing can be read there is no quota.
"""

from __future__ import annotations

from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")  # which cgroup this process is in, per hierarchy
CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")  # where a v1 cpu controller is mounted


def cpu_quota() -> float | None:
    """CPUs' worth of time per period this process may use, the tightest of its cgroup and its parents
    (v2: cpu.max, "150000 100000" is 1.5; v1: cpu.cfs_quota_us / cpu.cfs_period_us); None: no quota."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2's one hierarchy
            base = CGROUP_ROOT
        elif "cpu" in controllers.split(","):
            base = next((CGROUP_ROOT / d for d in V1_CPU_DIRS if (CGROUP_ROOT / d).is_dir()), None)
        else:
            continue
        if base is None:
            continue
        # Its own directory and each parent up to the mount (inside a container the path may name the
        # host's hierarchy, absent here: the mount itself is then the container's own cgroup).
        directory = base / path.strip("/")
        for d in [directory, *directory.parents]:
            quota = _quota_in(d)
            if quota is not None:
                quotas.append(quota)
            if d == base:
                break
    return min(quotas) if quotas else None


def _quota_in(directory: Path) -> float | None:
    try:
        if (directory / "cpu.max").is_file():
            limit, period = (directory / "cpu.max").read_text().split()
            return None if limit == "max" else int(limit) / int(period)
        limit = int((directory / "cpu.cfs_quota_us").read_text())
        return None if limit < 0 else limit / int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):  # no such file, or nothing a quota is written as
        return None
