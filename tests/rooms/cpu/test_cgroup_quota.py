"""A container's CPU quota, read from its cgroup (minfer/cpu/cgroup.py), caps the threads minfer starts.
The cgroup trees here are written in a temporary directory, as Linux lays them out."""

import pytest

from minfer.cpu import cgroup, threads


def lay_out(tmp_path, monkeypatch, membership: str, files: dict[str, str]):
    """/proc/self/cgroup holding `membership`, and a cgroup tree of `files` ({path: text})."""
    (tmp_path / "proc").write_text(membership)
    for name, text in files.items():
        path = tmp_path / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(cgroup, "PROC_CGROUP", tmp_path / "proc")
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", tmp_path / "sys")


@pytest.mark.parametrize("membership, files, quota", [
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # v2, no limit
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),  # docker run --cpus 1.5, inside its namespace
    ("0::/pod/app\n", {"pod/cpu.max": "100000 100000\n", "pod/app/cpu.max": "max 100000\n"}, 1.0),  # a parent's
    ("0::/pod/app\n", {"pod/cpu.max": "300000 100000\n", "pod/app/cpu.max": "50000 100000\n"}, 0.5),  # the tightest
    ("0::/docker/abc\n", {"cpu.max": "200000 100000\n"}, 2.0),  # the host's path, absent here: the mount's own
    ("4:cpu,cpuacct:/\n1:name=systemd:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                            "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),  # v1, no limit
    ("4:cpu,cpuacct:/job\n", {"cpu,cpuacct/job/cpu.cfs_quota_us": "100000\n",
                              "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}, 1.0),
    ("3:cpu:/\n", {"cpu/cpu.cfs_quota_us": "garbage\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("3:memory:/\n", {"memory/memory.limit_in_bytes": "1\n"}, None),  # no cpu controller
])
def test_the_quota_is_read_as_linux_lays_it_out(tmp_path, monkeypatch, membership, files, quota):
    lay_out(tmp_path, monkeypatch, membership, files)
    assert cgroup.cpu_quota() == quota


def test_no_cgroup_file_is_no_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "PROC_CGROUP", tmp_path / "absent")
    assert cgroup.cpu_quota() is None


@pytest.mark.parametrize("quota, cores, wanted, origin", [
    (None, 4, 4, "one per core"),
    (1.0, 4, 1, "a CPU quota of 1"),
    (2.5, 4, 2, "a CPU quota of 2.5"),  # whole CPUs: a third thread would be throttled
    (0.5, 4, 1, "a CPU quota of 0.5"),  # never none
    (8.0, 4, 4, "one per core"),  # a quota above the cores changes nothing
])
def test_threads_stay_within_the_quota(monkeypatch, quota, cores, wanted, origin):
    monkeypatch.delenv("MINFER_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cpu_quota", lambda: quota)
    monkeypatch.setattr(threads, "cores_allowed", lambda: list(range(cores)))
    assert threads.threads_and_origin() == (wanted, origin) and threads.cpu_threads_wanted() == wanted
    assert threads.threads_and_origin(3) == (3, "--num-threads")  # the user's stands
