"""The engine event feed and /engine/events: a bounded feed that never waits on a viewer, events
that replay to the allocator's true block states, no text in the feed, the API key, shutdown."""

import http.client
import json
import signal
import socket
import threading
import time

import pytest
from serving import ServerProcess, open_stream

from minfer import EngineConfig
from minfer.server.engine_events import EngineFeed, FeedClosed
from minfer.server.serve import create_server

KEY = "live-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = "zebra"  # a word in every prompt: it must never appear in the feed


def step(n):
    return {"type": "step", "step": n}


def test_feed_is_bounded_and_a_slow_viewer_resyncs_from_a_snapshot():
    wakes = []
    feed = EngineFeed(wake=lambda: wakes.append(1), capacity=8)
    feed.publish(step(0))  # no viewer: nothing publishes normally, but nothing breaks either
    assert not feed.active
    with feed.subscribe() as viewer:
        assert feed.active
        assert viewer.read(timeout=0.01) == []  # nothing until a snapshot
        assert feed.snapshot_wanted and wakes  # ... which the worker is asked (and woken) for
        feed.publish({"type": "snapshot"})
        feed.publish(step(1))
        assert [e["type"] for e in viewer.read(0.01)] == ["snapshot", "step"]
        assert not feed.snapshot_wanted
        start = time.perf_counter()
        for n in range(10_000):  # the viewer stalls: the worker goes on, memory stays bounded
            feed.publish(step(n))
        assert time.perf_counter() - start < 5  # generous: publishing is a deque append
        assert viewer.read(0.01) == [] and feed.snapshot_wanted  # it lost events: wait for a snapshot
        feed.publish({"type": "snapshot"})
        feed.publish(step(10_001))
        assert [e.get("step") for e in viewer.read(0.01)] == [None, 10_001]
        with feed.subscribe() as late:  # a late viewer starts from the latest snapshot in the ring
            assert [e.get("step") for e in late.read(0.01)] == [None, 10_001]
    assert not feed.active
    with feed.subscribe() as viewer:  # the ring was emptied when the last viewer left: events had stopped
        assert viewer.read(0.01) == [] and feed.snapshot_wanted
        feed.close()
        with pytest.raises(FeedClosed):
            viewer.read(1.0)


def test_each_event_is_encoded_once_however_many_viewers_read_it(monkeypatch):
    import minfer.server.engine_events as engine_events

    encoded = []
    real_dumps = json.dumps
    monkeypatch.setattr(engine_events.json, "dumps", lambda obj, **kw: encoded.append(obj) or real_dumps(obj, **kw))
    feed = EngineFeed(capacity=8)
    viewers = [feed.subscribe() for _ in range(5)]
    feed.publish({"type": "snapshot", "blocks": "ff"})
    feed.publish(step(1))
    messages = [v.read_json(0.01) for v in viewers]
    assert all(json.loads(m) == [{"type": "snapshot", "blocks": "ff"}, step(1)] for m in messages)
    assert len(encoded) == 2  # one encoding per event, not per viewer
    feed.publish(step(2))
    assert [json.loads(v.read_json(0.01)) for v in viewers[:2]] == [[step(2)]] * 2
    assert viewers[2].read(0.01) == [step(2)]  # the dict reader sees the same events
    assert len(encoded) == 3 and viewers[3].read_json(0.01) != b"" and viewers[3].read_json(0.01) == b""
    for v in viewers:
        v.__exit__(None, None, None)


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    # 24 blocks of 16 tokens: four requests of ~120 tokens do not fit at once, so some are preempted.
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=24, max_num_seqs=4), port=0, api_key=KEY)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.stop()


def request(srv, method, path, headers=AUTH, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    conn.request(method, path, body=json.dumps(body) if body else None, headers=headers)
    return conn, conn.getresponse()


class FeedReader(threading.Thread):
    """Collects /engine/events messages (raw bytes and parsed events) in the background."""

    def __init__(self, srv):
        super().__init__(daemon=True)
        self.conn, self.resp = request(srv, "GET", "/engine/events")
        assert self.resp.status == 200 and self.resp.getheader("Content-Type") == "text/event-stream"
        self.raw, self.events, self.ended = [], [], threading.Event()
        self.start()

    def run(self):
        try:
            for line in self.resp:
                self.raw.append(line)
                if line.startswith(b"data: "):
                    self.events += json.loads(line[6:])
        except (OSError, http.client.HTTPException):  # close() cut it mid-chunk
            pass
        self.ended.set()

    def close(self):
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        assert self.ended.wait(5)
        self.conn.close()

    def wait_for(self, predicate, timeout=30):
        deadline = time.monotonic() + timeout
        while not any(predicate(e) for e in list(self.events)):
            assert time.monotonic() < deadline, "the feed never showed it"
            time.sleep(0.02)


def stream(srv, prompt, max_tokens, ids):
    conn, resp = request(
        srv,
        "POST",
        "/v1/completions",
        body={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True},
    )
    assert resp.status == 200
    ids.append(resp.getheader("X-Engine-Request-Id"))
    resp.read()
    conn.close()


def test_page_is_self_contained(server):
    conn, resp = request(server, "GET", "/", headers={})  # the page holds no data: no key needed
    html = resp.read().decode()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/html")
    assert 'id="blocks"' in html and "/engine/events" in html and "function drawBlockMap" in html
    for name in ("live.css", "charts.js", "blockmap.js", "live.js"):
        assert f"/* {name} */" not in html  # inlined
    assert "http://" not in html and "https://" not in html  # no CDN, nothing from elsewhere


def test_feed_needs_the_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        conn, resp = request(server, "GET", "/engine/events", headers=headers)
        assert resp.status == 401 and json.loads(resp.read())["error"]["code"] == "invalid_api_key"


def test_events_replay_to_the_true_block_states(server):
    reader = FeedReader(server)
    reader.wait_for(lambda e: e["type"] == "snapshot")
    snapshot = reader.events[0]
    allocator_blocks = server.manager.stats()["num_kv_blocks_total"]
    assert snapshot["type"] == "snapshot" and snapshot["num_blocks"] == len(snapshot["blocks"]) == allocator_blocks
    ids = []
    prompt = f"{SECRET} " * 40  # the same prompt four times: later ones hit the prefix cache
    threads = [threading.Thread(target=stream, args=(server, prompt, 80, ids)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader.wait_for(lambda e: len(set(ids) - finished_ids(reader.events)) == 0)

    states = list(snapshot["blocks"])
    used_seen = 0
    for e in reader.events[1:]:
        for b, state in e["blocks"].items():
            states[int(b)] = state[0]
        used_seen = max(used_seen, states.count("u"))
    assert used_seen > 0 and "u" not in states  # blocks were used while streams ran, none after
    assert "c" in states  # the finished requests left their full blocks in the prefix cache
    steps = [e for e in reader.events if e["type"] == "step"]
    assert {c[0] for s in steps for c in s["chunks"]} == set(ids)
    assert all(s["num_prefill_tokens"] + s["num_decode_tokens"] == sum(c[2] for c in s["chunks"]) for s in steps)
    assert any(r[6] > 0 for s in steps for r in s["running"])  # a prefix-cache hit, shown as cached tokens
    assert any(s["preempted"] for s in steps)  # 24 blocks were too few for four at once
    check_running_counts(reader.events)
    raw = b"".join(reader.raw)
    assert SECRET.encode() not in raw  # ids, lengths and block ids only: no text
    reader.close()


def test_n_samples_show_their_shared_blocks(server):
    """A request with n = 4: its choices appear as id, id.1, id.2, id.3, holding the prompt's blocks as
    shared ones; replaying the tables (copy-on-write rewrites a table's last entry) gives exactly the
    blocks the feed calls shared, at every step; at the end none is."""
    reader = FeedReader(server)
    reader.wait_for(lambda e: e["type"] == "snapshot")
    conn, resp = request(server, "POST", "/v1/completions", body={
        "prompt": f"{SECRET} " * 30 + "x", "max_tokens": 20, "ignore_eos": True, "n": 4, "temperature": 1.0})
    assert resp.status == 200 and len(json.loads(resp.read())["choices"]) == 4
    conn.close()
    reader.wait_for(lambda e: any(r[0].endswith(".3") for r in e["running"]))
    rid = next(r[0] for e in reader.events for r in e["running"] if r[0].endswith(".3")).rsplit(".", 1)[0]
    reader.wait_for(lambda e: {f"{rid}.{k}" for k in (1, 2, 3)} | {rid} <= finished_ids(reader.events))
    snapshot = reader.events[0]
    tables = {i: blocks for i, (_, blocks) in snapshot["tables"].items()}
    shared, most = set(snapshot["shared"]), 0
    for e in reader.events[1:]:
        for i, (offset, blocks) in e["tables"].items():
            tables[i] = (tables.get(i, [])[:offset] if offset else []) + blocks
        running = {r[0] for r in e["running"]}
        tables = {i: t for i, t in tables.items() if i in running}
        shared = (shared - {int(b) for b in e["blocks"]}) | set(e["shared"])
        held = [b for t in tables.values() for b in t]
        assert shared == {b for b in held if held.count(b) > 1}, e["step"]
        most = max(most, len(shared))
    assert most >= 2 and not shared, "the prompt's blocks were shown shared while the four ran, and none after"
    reader.close()


def check_running_counts(events):
    """A step's num_seqs counts the sequences that ran in it, those that finished in it too; its
    `running` (what the page's header counts) lists those running after it, which also holds any
    that the token budget left out of the step. The page's step caption gives both."""
    before = set()
    for e in events:
        after = {r[0] for r in e["running"]}
        if e["type"] == "step":
            ran, finished = {c[0] for c in e["chunks"]}, {f[0] for f in e["finished"]}
            assert e["num_seqs"] == len(ran) == len(e["chunks"]) and finished <= ran
            assert after == (before - set(e["preempted"]) | ran) - finished
        elif e["type"] == "update":
            assert after == before - set(e["discarded"]) - set(e["preempted"])
        before = after
    steps = [e for e in events if e["type"] == "step"]
    assert any(e["num_seqs"] != len(e["running"]) for e in steps)  # so the two counts differ, truthfully


def finished_ids(events):
    return {f[0] for e in events if e["type"] != "snapshot" for f in e["finished"]}


def test_no_viewer_no_events(tiny_checkpoint):
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        stream(srv, "hello", 8, [])
        assert not srv.manager.events.active and not srv.manager.events.snapshot_wanted
        with srv.manager.events.subscribe() as viewer:  # the ring is empty: nothing was published
            assert viewer.read(0.01) == []
    finally:
        srv.stop()


def test_stop_ends_the_event_stream(tiny_checkpoint):
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    reader = FeedReader(srv)
    reader.wait_for(lambda e: e["type"] == "snapshot")
    start = time.monotonic()
    srv.stop()
    assert reader.ended.wait(5), "the SSE stream outlived the server"
    assert time.monotonic() - start < 5
    assert reader.raw[-1] == b"0\r\n" or b"".join(reader.raw).endswith(b"\n\n")  # ended cleanly


def test_sigterm_under_load_ends_every_viewer_stream(tiny_checkpoint, tmp_path):
    """A viewer busy with a flowing feed missed the engine's close and waited out its read; the process had
    exited by then and its streams were cut mid-chunk, never ended."""
    srv = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--num-kv-blocks", "64")
    try:
        stream = open_stream(srv.port, {"prompt": "hi", "max_tokens": 400, "ignore_eos": True})  # a busy engine
        viewers = []
        for _ in range(4):
            viewer = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            viewer.sendall(b"GET /engine/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n\r\n")
            assert viewer.recv(65536).startswith(b"HTTP/1.1 200")
            viewers.append(viewer)
        time.sleep(0.3)  # step events flowing
        srv.proc.send_signal(signal.SIGTERM)
        for viewer in viewers:
            received = b""
            while chunk := viewer.recv(65536):
                received += chunk
            assert received.endswith(b"0\r\n\r\n"), received[-80:]  # the last chunk: the stream ended
        assert srv.proc.wait(timeout=10) == 0
        stream.close()
        assert "Traceback" not in (tmp_path / "server.log").read_text()
    finally:
        srv.stop()


def test_a_viewer_arriving_as_the_engine_stops_gets_an_ended_stream(tiny_checkpoint):
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        srv.manager.shutdown()  # the engine has stopped; the server still accepts, for a moment
        conn, resp = request(srv, "GET", "/engine/events", headers={})
        assert resp.status == 200 and resp.read() == b""  # ended at once, cleanly: no error mid-stream
        conn.close()
    finally:
        srv.stop()


def test_a_viewer_has_ended_its_stream_before_it_counts_as_gone(tiny_checkpoint, monkeypatch):
    """stop() waits for viewers to leave, then the process exits: a viewer left (unsubscribed) first and
    ended its stream after, so at SIGTERM one stream in a few was still cut."""
    from minfer.server.endpoints import APIHandler

    real_end = APIHandler.end_stream
    monkeypatch.setattr(APIHandler, "end_stream", lambda self: (time.sleep(0.3), real_end(self)))  # a slow end
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        viewer = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=10)
        viewer.sendall(b"GET /engine/events HTTP/1.1\r\nHost: x\r\n\r\n")
        received = viewer.recv(65536)
        while b"data: " not in received:
            received += viewer.recv(65536)
        srv.manager.shutdown()
        assert srv.manager.events.wait_viewers_gone(5)
        viewer.setblocking(False)
        received = b""
        while True:
            try:
                received += viewer.recv(65536)
            except BlockingIOError:
                break
        assert received.endswith(b"0\r\n\r\n"), received[-40:]  # already out: the process may exit now
    finally:
        srv.stop()
