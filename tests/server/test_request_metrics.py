"""What the server reports of each request: the latency histograms of /metrics measured from the request's own
submission, and the log line per request (its status, tokens and time), whole for a batch of prompts and for a
stream cut short."""

import logging
import re
import threading
import time

import pytest
from serving import AUTH, call, metrics, open_stream, serving, stream_events

from minfer import EngineConfig, OnlineScheduler, SamplingParams
from minfer.models.gpt2 import GPT2
from minfer.server.manager import SchedulerManager
from minfer.server.messages import Done
from minfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with serving(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), api_key=AUTH["Authorization"][7:]) as srv:
        yield srv


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



def test_ttft_counts_a_request_discarded_after_its_first_token(server):
    """TTFT was observed when a request finished: one whose client gave up after its first token (a slow one,
    likely) was left out, and the histogram looked better the more clients gave up."""
    port = server.server_address[1]
    before = metrics(port)
    sock = open_stream(port, {"prompt": "Once", "max_tokens": 400, "ignore_eos": True})  # its first token is out
    sock.close()
    deadline = time.monotonic() + 10
    while (after := metrics(port))["minfer_requests_aborted_total"] == before["minfer_requests_aborted_total"]:
        assert time.monotonic() < deadline, "the request was never discarded"
        time.sleep(0.01)
    assert after["minfer_requests_finished_total"] == before["minfer_requests_finished_total"]
    count = "minfer_time_to_first_token_seconds_count"
    assert after[count] == before[count] + 1


# ---- the log line per request --------------------------------------------------------


def log_line(caplog, endpoint, after=0):
    """The first request log line of `endpoint` among the records from index `after` on, once it is written
    (the handler logs after its last byte is out)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [r.getMessage() for r in caplog.records[after:] if f'"POST {endpoint}"' in r.getMessage()]
        if lines:
            return lines[0]
        assert time.monotonic() < deadline, "no log line"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_logs_the_tokens_of_all_of_them(server, caplog, stream):
    """The log line counted the last prompt's tokens only: tokens=4+5 for a batch whose usage was 6+10."""
    caplog.set_level(logging.INFO, logger="minfer.serve")
    port, after = server.server_address[1], len(caplog.records)
    body = {"prompt": ["Once upon a time", "The dog"], "max_tokens": 5, "n": 2, "ignore_eos": True}
    if stream:
        usage = stream_events(port, "/v1/completions", {**body, "stream_options": {"include_usage": True}})[-2]["usage"]
    else:
        status, _, reply = call(port, "POST", "/v1/completions", body)
        assert status == 200
        usage = reply["usage"]
    assert usage["completion_tokens"] == 20
    assert f" 200 tokens={usage['prompt_tokens']}+20 " in log_line(caplog, "/v1/completions", after)


def test_a_stream_the_client_cut_logs_the_tokens_it_was_sent(server, caplog):
    caplog.set_level(logging.INFO, logger="minfer.serve")
    port, after = server.server_address[1], len(caplog.records)
    sock = open_stream(port, {"prompt": "Once", "max_tokens": 400, "ignore_eos": True})  # its first token is out
    sock.close()
    line = log_line(caplog, "/v1/completions", after)
    assert " 200 client-gone tokens=" in line, line
    prompt, completion = line.split("tokens=")[1].split()[0].split("+")
    assert int(prompt) >= 1 and 1 <= int(completion) < 400


def test_a_stream_the_server_cut_logs_the_tokens_it_was_sent(server, caplog):
    caplog.set_level(logging.INFO, logger="minfer.serve")
    runner = server.manager.scheduler.runner
    real_execute, calls = runner.execute, []

    def execute_then_fail(chunks):  # the prefill and two decodes run: three tokens, then the engine fails
        calls.append(1)
        if len(calls) == 4:
            runner.execute = real_execute
            raise RuntimeError("boom")
        return real_execute(chunks)

    runner.execute = execute_then_fail
    port, after = server.server_address[1], len(caplog.records)
    events = stream_events(port, "/v1/completions", {"prompt": "Once", "max_tokens": 20, "ignore_eos": True})
    assert events[-2]["error"]["type"] == "server_error"
    line = log_line(caplog, "/v1/completions", after)
    assert " 200 cut-by-server (500: " in line and re.search(r" tokens=\d+\+3 ", line), line
