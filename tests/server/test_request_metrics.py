"""What the server reports of each request: the latency histograms of /metrics measured from the request's own
submission, and the log line per request (its status, tokens and time), whole for a batch of prompts and for a
stream cut short."""

import logging
import threading
import time

import pytest
from serving import AUTH, open_stream, serving, stream_events

from minfer import EngineConfig, OnlineScheduler, SamplingParams
from minfer.models.gpt2 import GPT2
from minfer.server.manager import SchedulerManager
from minfer.server.messages import Done
from minfer.text.tokenizer import Tokenizer


def wait_done(handle):
    while not isinstance(event := handle.next_event(timeout=60), Done):
        assert event is not None, "timed out"
    return event.outputs


def test_ttft_counts_the_time_a_request_waited_for_a_busy_worker(tiny_checkpoint):
    """A request submitted while the worker is in a long step waits in the inbox until that step ends: its
    time to first token starts at submission, as its client sees it, not when the worker takes it in."""
    model, tokenizer = GPT2.from_pretrained(tiny_checkpoint), Tokenizer.from_dir(tiny_checkpoint)
    scheduler = OnlineScheduler(model, tokenizer, num_kv_blocks=64)
    in_step, go_on, real_step = threading.Event(), threading.Event(), scheduler.step

    def held_step():  # the first step waits until the test lets it go: a long prefill, say
        in_step.set()
        go_on.wait(30)
        return real_step()

    scheduler.step = held_step
    manager = SchedulerManager(scheduler)
    manager.start()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    try:
        first = manager.submit(manager.check([1, 2, 3], params))
        assert in_step.wait(30)
        waiting = manager.submit(manager.check([4, 5, 6], params))  # lands in the inbox during the step
        time.sleep(0.3)
        go_on.set()
        (first_out,), (out,) = wait_done(first), wait_done(waiting)
        for handle in (first, waiting):
            manager.release(handle)
    finally:
        manager.shutdown()
    assert out.first_token_time - out.arrival_time >= 0.3
    ttft = manager.metrics.ttft
    assert ttft.count == 2 and ttft.sum >= 0.6  # each waited 0.3 s at least: the first in the held step
    assert sum(n for bound, n in zip(ttft.buckets, ttft.counts) if bound < 0.3) == 0
