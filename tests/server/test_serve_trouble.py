"""The server in trouble, in-process on a random checkpoint: a full queue answers 429, a failing engine step
(or what follows it, an admission, a discard) fails its requests and the server keeps serving, a stream that
fails to be written ends with an error event, a client that leaves has its request discarded, a dead engine
worker (a bug in its loop, or a failure that leaves blocks behind) makes every request and /health a 503."""

import json
import socket
import threading
import time

import pytest
from serving import call, metrics, stream_events, wait_all_free

from minfer import EngineConfig
from minfer.server.responder import Responder
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


def fail_once(owner, name: str, error=RuntimeError):
    """owner.name raises error("boom") at its next call, then works again."""
    real = getattr(owner, name)

    def failing(*args, **kwargs):
        setattr(owner, name, real)
        raise error("boom")

    setattr(owner, name, failing)


@pytest.mark.parametrize("part", ["get_new_outputs", "pop_responses", "on_finished", "recorder", "discard"])
def test_a_failure_anywhere_in_a_step_fails_its_requests_and_the_worker_serves_on(small_server, part):
    """What follows a step (its tokens and text handed out, finishes popped, metrics, the live view's event) and
    a discard between steps ran outside the worker's guard: one failure there killed the worker, and every later
    request got a 503. Now each is a failed step: its requests get a 500, the next request runs."""
    manager, port = small_server.manager, small_server.server_address[1]
    owner, name = {"get_new_outputs": (manager.scheduler, "get_new_outputs"),
                   "pop_responses": (manager.scheduler, "pop_responses"), "on_finished": (manager.metrics, "on_finished"),
                   "recorder": (manager._recorder, "step"), "discard": (manager.scheduler, "discard_request")}[part]
    with manager.events.subscribe():  # a live-view viewer: the worker records each step for it
        if part == "discard":  # a client that leaves mid-stream: the worker discards its request
            entered, gate = hold_engine(small_server)
            data = json.dumps({"prompt": "Hi", "max_tokens": 50, "stream": True}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
                assert entered.wait(10)
            assert manager.wait_released(5)
            fail_once(owner, name, KeyError)
            gate.set()
        else:
            fail_once(owner, name, KeyError)  # a KeyError, as a stale request id would raise
            status, _, body = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            assert status == 500 and body["error"]["type"] == "server_error" and "boom" not in json.dumps(body)
        assert manager.wait_released(5)
        status, _, out = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    assert call(port, "GET", "/health", headers={})[0] == 200
    wait_all_free(small_server)
    assert not manager.scheduler.requests


def test_a_request_whose_admission_fails_gets_a_500_and_leaves_nothing_behind(small_server):
    """A feature's hook that fails while a request is added (here scoring's) left it half added: a ValueError
    was taken for the scheduler's refusal, a 400 quoting the bug's message, and the request stayed registered;
    any other error killed the worker."""
    manager, port = small_server.manager, small_server.server_address[1]
    fail_once(manager.scheduler.features.scoring, "add", ValueError)
    status, _, body = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 1})
    assert status == 500 and "boom" not in json.dumps(body)
    assert manager.wait_released(5)
    assert not manager.scheduler.requests
    assert call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 1})[0] == 200


def test_a_bug_while_writing_a_stream_ends_it_with_an_error_event(small_server, monkeypatch):
    """A stream the Responder failed to write was cut without a word: no error event, no [DONE]."""
    real, calls = Responder.delta_chunks, []

    def failing_once(self, delta, prompt=0):
        calls.append(delta)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(self, delta, prompt)

    monkeypatch.setattr(Responder, "delta_chunks", failing_once)
    events = stream_events(small_server.server_address[1], "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert "boom" not in json.dumps(events)
    assert small_server.manager.wait_released(5)
    wait_all_free(small_server)


def test_a_failed_step_that_leaves_blocks_behind_stops_the_worker(small_server):
    """After a failed step the worker discards what was in flight; if that cannot free it all, no later step can
    work (each failed on the leftovers, and /health said ok while every request got a 500): the worker stops."""
    manager, port = small_server.manager, small_server.server_address[1]
    manager.scheduler.batcher.discard = lambda seq: None  # a discard that frees nothing
    fail_once(manager.scheduler.runner, "execute")
    status, _, body = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and body["error"]["type"] == "server_error"
    status, _, health = call(port, "GET", "/health", headers={})  # no wait: the answer came once it was dead
    assert status == 503 and "could not be freed" in health["reason"]
    assert call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 503


def test_a_request_the_dead_worker_never_answered_gets_a_503(small_server):
    """The worker dies while admitting a request (in the admission's own guard): the request is out of the inbox
    and in no table, so the worker's wind-down cannot answer it. Its handler sees the worker gone and answers."""
    manager = small_server.manager

    def broken(handle):
        raise RuntimeError("bug in the admission's guard")

    manager._add = broken
    port = small_server.server_address[1]
    start = time.monotonic()
    status, _, body = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 503 and body["error"]["message"] == "the engine has stopped"
    assert time.monotonic() - start < 30  # not the client's own timeout: the handler noticed
    assert call(port, "GET", "/health", headers={})[0] == 503


def test_dead_worker_fails_requests_and_health_says_503(small_server):
    scheduler = small_server.manager.scheduler
    has_unfinished = scheduler.has_unfinished

    def broken():  # a bug in the worker's loop itself, not in a step: the loop dies
        if has_unfinished():
            raise RuntimeError("bug in the loop")
        return False

    scheduler.has_unfinished = broken
    port = small_server.server_address[1]
    status, _, body = call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 503 and body["error"]["type"] == "server_error"
    assert call(port, "GET", "/health", headers={})[0] == 503
    assert call(port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3})[0] == 503
