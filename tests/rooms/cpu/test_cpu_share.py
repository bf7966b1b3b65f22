"""CpuShare: torch's thread count follows the cores other processes leave free (minfer/cpu/thread_share.py)."""

import os

import pytest
import torch

from minfer.cpu import thread_share as cpu_share
from minfer.cpu import threads as thread_count


class FakeMachine:
    """/proc as CpuShare reads it, driven by the test: 2 cores, a clock, our ticks and everybody's."""

    def __init__(self, monkeypatch):
        self.now, self.busy, self.own = 0.0, 0, 0
        monkeypatch.setattr(cpu_share, "cores_allowed", lambda: [0, 1])
        monkeypatch.setattr(cpu_share, "_busy_ticks", lambda cores: self.busy)
        monkeypatch.setattr(cpu_share, "_own_ticks", lambda: self.own)
        monkeypatch.setattr(cpu_share.time, "monotonic", lambda: self.now)

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass with this process using `ours` cores and other processes `others`."""
        ticks = seconds * cpu_share._TICKS_PER_S
        self.now += seconds
        self.own += round(ours * ticks)
        self.busy += round((ours + others) * ticks)


@pytest.fixture
def restore_threads():
    """Start from the 2 threads of FakeMachine's 2 cores (conftest pins tests to 1); restore after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    share = cpu_share.CpuShare(max_threads=2)
    assert share.enabled
    machine.run(1.0, ours=2.0, others=0.0)  # quiet: both cores are ours
    assert share.update() == 2 == torch.get_num_threads()
    machine.run(1.0, ours=1.33, others=0.67)  # one busy process: the scheduler shares 3 threads over 2 cores
    assert share.update() == 1 == torch.get_num_threads()
    assert share.others == pytest.approx(0.67, abs=0.01)
    machine.run(1.0, ours=1.0, others=1.0)  # still there: one core each
    assert share.update() == 1
    machine.run(1.0, ours=1.0, others=0.0)  # it left
    assert share.update() == 2 == torch.get_num_threads()
    assert share.changes == 2


def test_light_use_by_others_keeps_every_thread(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    share = cpu_share.CpuShare(max_threads=2)
    machine.run(1.0, ours=1.8, others=0.4)  # a browser tab, a shell: less than half a core
    assert share.update() == 2


def test_it_measures_at_most_twice_a_second(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    share = cpu_share.CpuShare(max_threads=2)
    machine.run(0.1, ours=1.0, others=1.0)
    assert share.update() == torch.get_num_threads()  # too soon: nothing measured
    assert share.others == 0.0
    machine.run(0.5, ours=1.0, others=1.0)
    assert share.update() == 1


def test_a_thread_count_the_user_chose_is_left_alone(monkeypatch, restore_threads):
    for var in thread_count.THREAD_ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    assert not thread_count.threads_chosen(None)
    assert thread_count.threads_chosen(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert thread_count.threads_chosen(None)
    machine = FakeMachine(monkeypatch)
    share = cpu_share.CpuShare(enabled=False, max_threads=2)
    machine.run(1.0, ours=1.0, others=1.0)
    torch.set_num_threads(2)
    assert share.update() == 2 == torch.get_num_threads()


def test_the_real_proc_files_give_a_sane_share(restore_threads):
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc here (not Linux): CpuShare stays off")
    share = cpu_share.CpuShare(max_threads=2)
    assert share.enabled
    share._last = (share._last[0] - 1.0, *share._last[1:])  # pretend a second passed
    threads = share.update()
    assert 1 <= threads <= 2
    assert 0.0 <= share.others <= len(share.cores) + 0.5


def test_the_engine_adapts_only_when_threads_were_not_chosen(tiny_checkpoint, monkeypatch, restore_threads):
    from minfer import LLM

    for var in thread_count.THREAD_ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    threads = LLM(tiny_checkpoint, num_kv_blocks=16).scheduler.features.threads
    assert threads is not None and threads.enabled == (len(thread_count.cores_allowed()) > 1)
    assert LLM(tiny_checkpoint, num_kv_blocks=16, num_threads=1).scheduler.features.threads is None
