"""Connection limits (minfer/server/connections.py, connection_limits.py): request, keep-alive and write timeouts, and the connection cap,
on an in-process server with short limits."""

import http.client
import json
import socket
import socketserver
import threading
import time

import pytest

from minfer import EngineConfig
from minfer.server import prometheus
from minfer.server.connection_limits import ConnectionLimits
from minfer.server.serve import create_server

LIMITS = ConnectionLimits(request_timeout=1.0, keepalive_timeout=0.5, write_timeout=1.0, max_connections=6)


@pytest.fixture(scope="module")
def server(make_checkpoint):
    srv = create_server(EngineConfig(str(make_checkpoint(n_positions=1024)), num_kv_blocks=400), port=0, limits=LIMITS)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield srv
    srv.stop(grace=1.0)


def connect(server, rcvbuf=None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:  # a small receive window: the server's writes block soon after the client stops reading
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.server_address[1]))
    return sock


def read_until_closed(sock) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def recv_until(sock, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before {marker!r}: {data!r}"
        data += chunk
    return data


def request(method, path, body=None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    return b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (method, path, len(data), data)


def metric(server, name) -> float:
    lines = prometheus.render(server.manager.metrics, server.manager.stats()) + prometheus.connection_lines(server.stats)
    return float(next(line.rsplit(" ", 1)[1] for line in lines.splitlines() if line.startswith(name + " ")))


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def wait_idle(server):
    """Every connection from earlier tests closed, every block free."""
    wait_for(lambda: metric(server, "minfer_http_connections_open") == 0)
    stats = server.manager.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"] and stats["num_running"] == 0


@pytest.mark.parametrize(
    "sent",
    [
        b'POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"prompt":',  # body never finished
        b"GET /health HTTP/1.1\r\nHost: x",  # headers never finished
    ],
)
def test_stalled_request_gets_408_and_is_closed(server, sent):
    before = metric(server, 'minfer_http_timeouts_total{kind="request"}')
    with connect(server) as sock:
        sock.sendall(sent)
        reply, took = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert "did not arrive within 1 s" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert 0.8 < took < 5
    assert metric(server, 'minfer_http_timeouts_total{kind="request"}') == before + 1


def test_content_lengths_that_disagree_are_a_400_and_the_connection_closes(server):
    """Which one frames the body? A proxy and this server could read two different requests out of it."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
    with connect(server) as sock:
        sock.sendall(head + b"Content-Length: 3\r\n\r\n" + body + request(b"GET", b"/health"))
        reply, _ = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"Content-Length headers disagree" in reply
    assert reply.count(b"HTTP/1.1") == 1  # nothing after it is read as a request
    with connect(server) as sock:  # the same length twice frames one body: served
        sock.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        assert read_until_closed(sock)[0].startswith(b"HTTP/1.1 200")


def test_a_4xx_keeps_the_connection(server, monkeypatch):
    """A pooled client (the openai SDK's) reuses its connection after a 4xx: a body the endpoint never read
    (401, 404, 405 answer before reading it) is read and dropped, so it is not taken for the next request."""
    monkeypatch.setattr(server, "api_key", "k")
    key = {"Authorization": "Bearer k"}
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    sent = [("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, key, 400),
            ("POST", "/v1/completions", '{"prompt": "Hi",', key, 400),  # not JSON
            ("GET", "/nowhere", None, {}, 404),
            ("POST", "/nowhere", {"prompt": "Hi"}, {}, 404),
            ("PUT", "/v1/completions", {"prompt": "Hi"}, key, 405),
            ("POST", "/v1/completions", {"prompt": "Hi"}, {}, 401),
            ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key, 200)]
    sockets = set()
    for method, path, body, headers, status in sent:
        conn.request(method, path, body=body if body is None or isinstance(body, str) else json.dumps(body),
                     headers=headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == status and resp.getheader("Connection") != "close", (method, path)
        sockets.add(conn.sock)
    assert len(sockets) == 1  # one connection served them all
    conn.close()


@pytest.mark.parametrize("head", [b"Content-Length: 2\r\nTransfer-Encoding: chunked",
                                  b"Content-Length: 2\r\nTransfer-Encoding: identity",
                                  b"Content-Length: %d" % ((1 << 20) + 1),  # over the body limit
                                  b"Content-Length: 2\r\nContent-Length: 3",
                                  b"Content-Length: 100"])  # not all sent: the 404 after the request timeout
def test_a_body_that_is_not_dropped_closes_the_connection(server, head):
    """A 404's body is dropped only where one Content-Length frames it, within the body limit, and it arrives
    in time: the rest (chunked, too big, framed two ways) may hold a smuggled request; the connection closes."""
    with connect(server) as sock:
        sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n{}" % head + request(b"GET", b"/health"))
        reply, _ = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 404 ") and b"Connection: close\r\n" in reply
    assert reply.count(b"HTTP/1.1 ") == 1


@pytest.mark.parametrize("method, path, meant", [("POST", "/v1/completions/", "/v1/completions"),
                                                 ("GET", "/v1/models/", "/v1/models"),
                                                 ("GET", "/v1/models/some-model//", "/v1/models/some-model"),
                                                 ("GET", "/health/", "/health"),
                                                 ("POST", "/v1/embeddings", None)])
def test_an_unknown_path_is_a_404_that_names_the_endpoint_meant(server, method, path, meant):
    """A path with a trailing slash is not the endpoint: a 404, whose message names the endpoint without it."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request(method, path, body=json.dumps({"prompt": "Hi"}) if method == "POST" else None)
    resp = conn.getresponse()
    error = json.loads(resp.read())["error"]
    assert resp.status == 404 and error["code"] == "not_found"
    assert error["message"] == f"no such endpoint: {path}" + (f" (did you mean {meant}?)" if meant else "")
    conn.close()


def test_head_gets_a_gets_headers_without_its_body(server):
    """HEAD on a GET route: the GET's status and headers, no body (it was a 501 with an HTML body); on a POST
    route a 405 naming POST. The connection serves on: a stray body would be read as the next reply."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    conn.request("GET", "/v1/models")
    got = conn.getresponse()
    body = got.read()
    for method, path, status, content_type in [("HEAD", "/v1/models", 200, "application/json"),
                                               ("HEAD", "/engine/events", 200, "text/event-stream"),
                                               ("HEAD", "/v1/completions", 405, "application/json"),
                                               ("HEAD", "/nowhere", 404, "application/json")]:
        conn.request(method, path)
        resp = conn.getresponse()
        assert (resp.status, resp.getheader("Content-Type"), resp.read()) == (status, content_type, b"")
        assert status != 405 or resp.getheader("Allow") == "POST"
    conn.request("DELETE", "/v1/models")
    resp = conn.getresponse()
    assert (resp.status, resp.getheader("Allow")) == (405, "GET, HEAD") and resp.read()
    sock = conn.sock
    conn.request("GET", "/v1/models")
    again = conn.getresponse()
    assert again.read() == body and conn.sock is sock  # the same connection, in step
    conn.close()
    raw = connect(server)
    raw.sendall(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply, _ = read_until_closed(raw)
    assert reply.endswith(b"\r\n\r\n") and b"Content-Length: %d\r\n" % len(body) in reply  # no byte of body


def test_a_body_no_endpoint_reads_is_dropped(server):
    """A GET with a body: answered, its body dropped, and the next request on the connection served (kept
    unread, the body was read as the next request's method: a 501 "Unsupported method ('{}GET')")."""
    with connect(server) as sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
                     + request(b"GET", b"/version")[:-2] + b"Connection: close\r\n\r\n")
        reply, _ = read_until_closed(sock)
    assert reply.count(b"HTTP/1.1 200 ") == 2 and b"501" not in reply


@pytest.mark.parametrize("length", [b"\xb2", b"-5", b"+5", b"0x10", b"5 5"])
def test_a_content_length_that_is_not_a_number_is_a_400(server, length):
    with connect(server) as sock:  # (latin-1 "\xb2" reads as "²", a digit to str.isdigit: it was a 500)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n\r\n{}" % length)
        reply, _ = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"bad Content-Length" in reply, reply[:200]


def test_silent_and_idle_connections_are_closed(server):
    with connect(server) as silent, connect(server) as kept:
        kept.sendall(request(b"GET", b"/health"))
        recv_until(kept, b"}}")  # the end of the body: {"status": "ok", "engine": {...}}
        reply, took = read_until_closed(kept)  # idle after one request: the keep-alive timeout
        assert reply == b"" and 0.3 < took < 5
        reply, _ = read_until_closed(silent)  # nothing ever sent: the request timeout, without a word
        assert reply == b""


def test_stream_being_read_slowly_is_not_cut_off(server):
    """Each write waits on the slow reader, well past the write timeout in all, but no single write does."""
    wait_idle(server)
    write_timeouts = metric(server, 'minfer_http_timeouts_total{kind="write"}')
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(request(b"POST", b"/v1/completions", body))
        start, data = time.monotonic(), b""
        while chunk := sock.recv(1024):  # about 50 KB/s
            data += chunk
            if data.endswith(b"0\r\n\r\n"):
                break
            time.sleep(0.02)
        took = time.monotonic() - start
    assert b"data: [DONE]" in data and b'"completion_tokens": 600' in data
    assert took > LIMITS.write_timeout  # the stream as a whole outlasted the write timeout
    assert metric(server, 'minfer_http_timeouts_total{kind="write"}') == write_timeouts


@pytest.fixture
def slow_steps(server):
    """Each engine step takes 5 ms more, so a 1000-token request outlasts the write timeout."""
    scheduler = server.manager.scheduler
    real_step = scheduler.step
    scheduler.step = lambda: (time.sleep(0.005), real_step())[1]
    yield
    scheduler.step = real_step


def test_client_that_stops_reading_is_cut_off_and_its_request_freed(server, slow_steps):
    wait_idle(server)
    before = metric(server, "minfer_requests_aborted_total")
    finished = metric(server, "minfer_requests_finished_total")
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with connect(server, rcvbuf=4096) as stalled:
        stalled.sendall(request(b"POST", b"/v1/completions", body))
        assert stalled.recv(100).startswith(b"HTTP/1.1 200")  # streaming has begun; read no more
        with connect(server) as other:  # meanwhile another request runs to its end
            other.sendall(request(b"POST", b"/v1/completions", {"prompt": "Hi", "max_tokens": 8}))
            recv_until(other, b'"completion_tokens": 8')
        wait_for(lambda: metric(server, 'minfer_http_timeouts_total{kind="write"}') >= 1)
    wait_for(lambda: metric(server, "minfer_requests_aborted_total") == before + 1)  # discarded, not finished
    assert metric(server, "minfer_requests_finished_total") == finished + 1  # only the other one finished
    wait_idle(server)  # its blocks are free


def test_connections_beyond_the_cap_get_503_and_health_still_answers(server):
    wait_idle(server)
    held = [connect(server) for _ in range(LIMITS.max_connections)]
    try:
        wait_for(lambda: metric(server, "minfer_http_connections_open") == LIMITS.max_connections)
        with connect(server) as sock:
            sock.sendall(request(b"POST", b"/v1/completions", {"prompt": "Hi", "max_tokens": 2}))
            reply, took = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in reply and took < 2
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        with connect(server) as sock:
            sock.sendall(request(b"GET", b"/health"))
            reply, took = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 200 ") and took < 2
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["status"] == "ok"
        assert metric(server, "minfer_http_connections_refused_total") >= 2
    finally:
        for sock in held:
            sock.close()
    wait_idle(server)
    with connect(server) as sock:  # below the cap again: served as usual
        sock.sendall(request(b"POST", b"/v1/completions", {"prompt": "Hi", "max_tokens": 2}))
        assert recv_until(sock, b'"usage"').startswith(b"HTTP/1.1 200 ")


def test_a_handler_thread_that_fails_to_start_gives_its_connection_back(server, monkeypatch):
    """socketserver closes a connection whose thread could not start (shutdown_request): its place under the
    cap comes back, and the server goes on serving."""
    wait_idle(server)

    def cannot_start(self, request, client_address):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(socketserver.ThreadingMixIn, "process_request", cannot_start)
    with connect(server) as sock:
        assert read_until_closed(sock)[0] == b""
    monkeypatch.undo()
    wait_idle(server)
    with connect(server) as sock:
        sock.sendall(request(b"GET", b"/health"))
        assert recv_until(sock, b'"status"').startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    "field, value", [("request_timeout", 0), ("keepalive_timeout", -1), ("write_timeout", "5"), ("max_connections", 0),
                     ("request_timeout", 1e10), ("write_timeout", float("inf")), ("keepalive_timeout", float("nan"))]
)  # 1e10 s overflowed the socket's timeout: every request's read failed
def test_bad_limits_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        ConnectionLimits(**{field: value})
