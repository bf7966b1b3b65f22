"""bench's floor: the read bandwidth is the fastest way found to stream the weights."""

import torch

from minfer.bench import roofline


def test_read_bandwidth_is_the_faster_of_a_whole_sum_and_a_part_per_thread(monkeypatch):
    """The floor is only a floor if nothing reads faster: a plain sum and a matvec over one part per
    thread (as the split one-row linears read) are both timed, and the faster one counts."""
    timed = []

    def fake_best_time(op, device, repeats=5):
        result = op()
        timed.append(result)
        return {0: 2.0, 1: 1.0, 2: 4.0}[len(timed) - 1]  # sum, the per-thread read, the copy

    monkeypatch.setattr(roofline, "best_time", fake_best_time)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    nbytes = 4 * 2 * 512 * 8  # 2 parts of (512, 8) floats
    read, copy = roofline.measure_bandwidth(torch.device("cpu"), nbytes=nbytes)
    assert read == nbytes / 1.0 and copy == 2 * nbytes / 4.0
    whole_sum, per_thread, _ = timed
    assert whole_sum.item() == nbytes // 4  # every float read, once
    assert per_thread.shape == (2, 1, 8) and per_thread.sum().item() == nbytes // 4
