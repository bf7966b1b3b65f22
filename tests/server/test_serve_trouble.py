"""The server in trouble, in-process on a random checkpoint: a full queue answers 429, a failing engine step
fails its requests and the server keeps serving, a client that leaves has its request discarded, a dead engine
worker makes every request and /health a 503."""

import json
import socket
import threading
import time

import pytest
from serving import call, metrics, stream_events

from minfer import EngineConfig
from minfer.server.serve import create_server


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(n_positions=1024)



@pytest.fixture
def small_server(checkpoint):
    """An in-process server that runs one request at a time and queues none."""
    srv = create_server(EngineConfig(str(checkpoint), num_kv_blocks=200, max_num_seqs=1), port=0, max_queued=0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.stop(grace=1.0)


def hold_engine(server):
    """Make the worker wait inside its next step until the returned gate is set."""
    scheduler = server.manager.scheduler
    entered, gate, real_step = threading.Event(), threading.Event(), scheduler.step

    def held_step():
        entered.set()
        gate.wait(10)
        return real_step()

    scheduler.step = held_step
    return entered, gate


def test_queue_full_is_429(small_server):
    entered, gate = hold_engine(small_server)  # so the first request stays in flight
    port = small_server.server_address[1]
    first = {}
    t = threading.Thread(target=lambda: first.update(r=call(port, "POST", "/generate", {"prompt": "a"})))
    t.start()
    assert entered.wait(10)
    status, _, body = call(port, "POST", "/generate", {"prompt": "b"})
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    gate.set()
    t.join(30)
    assert first["r"][0] == 200
    assert small_server.manager.wait_released(5)  # its handler has written the last byte
    assert call(port, "POST", "/generate", {"prompt": "c", "max_new_tokens": 2})[0] == 200  # a slot again


def test_a_batch_larger_than_the_server_holds_is_a_400_not_a_429(small_server):
    """A batch of more prompts than the server holds at once (max_num_seqs + max_queued) could never be taken: a
    429 "retry later" had clients retry it forever (the openai SDK retries a 429 by itself)."""
    port = small_server.server_address[1]
    status, _, body = call(port, "POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt" and "2 prompts" in body["error"]["message"]
    assert call(port, "POST", "/v1/completions", {"prompt": ["a"], "max_tokens": 1})[0] == 200


def test_engine_failure_fails_requests_and_keeps_serving(small_server):
    runner = small_server.manager.scheduler.runner
    real_execute = runner.execute

    def failing_execute(chunks):  # fails once, after the scheduler has given out KV blocks
        runner.execute = real_execute
        raise RuntimeError("boom")

    runner.execute = failing_execute
    port = small_server.server_address[1]
    events = stream_events(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 5})
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert "boom" not in json.dumps(events)  # internals stay in the server log
    assert call(port, "GET", "/health", headers={})[2]["status"] == "ok"
    # [DONE] can reach the client before its handler lets go of its slot (1 in-flight request allowed): wait.
    assert small_server.manager.wait_released(5)
    status, _, out = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 5})
    assert status == 200 and out["usage"]["completion_tokens"] >= 1
    stats = small_server.manager.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]


def test_a_step_that_fails_after_a_request_finished_keeps_the_worker_alive(small_server):
    """A step that fails after its tokens are recorded may have finished a request, which the failure then
    discards with the rest: no later step may report it finished (pop_responses would find no such request,
    and the worker would die)."""
    scoring = small_server.manager.scheduler.features.scoring
    real_record = scoring.record

    def failing_record(chunks):  # fails once, after the request's one token has finished it
        scoring.record = real_record
        raise RuntimeError("boom")

    scoring.record = failing_record
    port = small_server.server_address[1]
    status, _, body = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": 1})
    assert status == 500 and body["error"]["type"] == "server_error"
    assert small_server.manager.wait_released(5)
    status, _, out = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    assert call(port, "GET", "/health", headers={})[0] == 200


def test_non_stream_client_that_leaves_is_discarded(small_server):
    entered, gate = hold_engine(small_server)
    port = small_server.server_address[1]
    data = json.dumps({"prompt": "Hi", "max_new_tokens": 64}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        assert entered.wait(10)  # admitted and running
    assert small_server.manager.wait_released(5)  # the handler noticed the client left
    gate.set()
    deadline = time.monotonic() + 5
    while (m := metrics(port))["minfer_requests_aborted_total"] + m["minfer_requests_finished_total"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert m["minfer_requests_aborted_total"] == 1 and m["minfer_requests_finished_total"] == 0
    assert m["minfer_kv_blocks_free"] == m["minfer_kv_blocks_total"]


def test_a_client_that_leaves_while_tokens_flow_is_discarded(small_server):
    """The handler looked for a vanished client only after 0.5 s without an event: a non-stream request
    (or a stream whose text is held back) that sampled every step ran to max_tokens for nobody, holding its
    slot and blocks (30 such requests, n = 4, kept all 64 slots of a server busy for over 12 s)."""
    scheduler = small_server.manager.scheduler
    real_step = scheduler.step
    scheduler.step = lambda: (time.sleep(0.002), real_step())[1]  # 1000 tokens: 2 s at least
    port = small_server.server_address[1]
    data = json.dumps({"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        while metrics(port)["minfer_generation_tokens_total"] < 5:  # running, a token every step
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while (m := metrics(port))["minfer_requests_aborted_total"] + m["minfer_requests_finished_total"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert m["minfer_requests_aborted_total"] == 1 and m["minfer_requests_finished_total"] == 0
    assert m["minfer_generation_tokens_total"] < 900


def test_dead_worker_fails_requests_and_health_says_503(small_server):
    def broken(request_id):
        raise RuntimeError("bug outside step()")

    small_server.manager.scheduler.get_new_outputs = broken  # kills the worker loop itself
    port = small_server.server_address[1]
    status, _, body = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 503 and body["error"]["type"] == "server_error"
    assert call(port, "GET", "/health", headers={})[0] == 503
    assert call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})[0] == 503
