"""A GPU's KV cache, sized after a profiling step of the largest step (assembly/memory.py): checked on the CPU,
the device's memory readings handed in."""

import pytest

from minfer.assembly import memory
from minfer.assembly.memory import DeviceMemory, kv_cache_budget, profile_step, with_profiled_budget
from minfer.assembly.prepare import prepare_model
from minfer.engine.config import EngineConfig
from minfer.models.registry import load_model

GiB = 2**30


class FakeMemory:
    """A device of 80 GiB, 30 in use after the profiling step, 28 of them torch's, which peaked at 20."""

    def __init__(self):
        self.calls = []

    def reset_peak(self):
        self.calls.append("reset")

    def read(self):
        self.calls.append("read")
        return DeviceMemory(total=80 * GiB, used=30 * GiB, peak=20 * GiB, reserved=28 * GiB)


def test_the_cache_takes_the_share_less_the_peak_and_what_torch_does_not_hold():
    reading = DeviceMemory(total=80 * GiB, used=30 * GiB, peak=20 * GiB, reserved=28 * GiB)
    assert kv_cache_budget(0.9, reading) == int(0.9 * 80 * GiB) - 20 * GiB - 2 * GiB
    with pytest.raises(ValueError, match="nothing is left for the KV cache. Raise --gpu-memory-utilization"):
        kv_cache_budget(0.25, reading)


def test_the_profiling_step_is_the_largest_step(tiny_checkpoint, monkeypatch):
    """max_num_batched_tokens rows of fresh prompts no longer than the context, max_num_seqs of them sampled."""
    model, attention = prepare_model(load_model(tiny_checkpoint), EngineConfig(tiny_checkpoint))
    seen = []
    forward = type(model).forward

    def spy(self, input_ids, paged):
        seen.append((input_ids.shape[0], paged.sample_rows.shape[0], paged.attention.backend))
        return forward(self, input_ids, paged)

    monkeypatch.setattr(type(model), "forward", spy)
    assert profile_step(model, attention, 16, 700, 24, context_len=512) == 700  # prompts of 512 and 188 tokens
    assert seen == [(700, 24, attention)]


def test_the_budget_fixes_the_cache_in_bytes_before_it_exists(tiny_checkpoint, monkeypatch):
    model, attention = prepare_model(load_model(tiny_checkpoint), EngineConfig(tiny_checkpoint))
    steps = []
    monkeypatch.setattr(memory, "profile_step", lambda *args: steps.append(args))
    reading = FakeMemory()
    config = with_profiled_budget(EngineConfig(tiny_checkpoint, max_num_batched_tokens=256), model, attention, 512,
                                  reading)
    assert reading.calls == ["reset", "read"] and steps[0][3] == 256
    assert config.kv_cache_memory == int(0.9 * 80 * GiB) - 20 * GiB - 2 * GiB and config.gpu_memory_utilization is None
