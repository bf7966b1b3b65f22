"""Minfer servers for tests and raw clients for them: an in-process server started on a free port and
served on a thread (`serving`), a `python -m minfer.serve` process (`ServerProcess`), one request on a fresh
connection (`call`), an SSE stream read whole (`stream_events`) or held open (`open_stream`), /metrics, and
the waits and readings the server tests share."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

from minfer.server.serve import create_server


@contextmanager
def serving(config, **options):
    """`with serving(EngineConfig(...)) as srv:` the server answers on 127.0.0.1:srv.server_address[1]."""
    srv = create_server(config, port=0, **options)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


API_KEY = "test-key"
MODEL = "tiny-gpt2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class ServerProcess:
    def __init__(self, checkpoint, log_path, *args):
        cmd = [
            sys.executable,
            "-m",
            "minfer.serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
            "--served-model-name",
            MODEL,
            *args,
        ]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r}; log: {open(log_path).read()[-2000:]}")
        self.port = int(line.rsplit(":", 1)[1].split()[0])

    def cpu_seconds(self) -> float:
        fields = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def call(port, method, path, body=None, headers=AUTH, raw=None, timeout=30):
    """(status, response headers, parsed JSON or text) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type", "").startswith("application/json"):
        payload = json.loads(payload)
    return resp.status, resp, payload


def stream_events(port, path, body, timeout=60):
    """The parsed `data:` payloads of an SSE stream ("[DONE]" as a str)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers=AUTH)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = []
    for line in resp:
        if line.startswith(b"data: "):
            payload = line[6:].strip().decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    conn.close()
    return events


def metrics(port) -> dict[str, float]:
    _, _, text = call(port, "GET", "/metrics", headers={})
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def open_stream(port, body) -> socket.socket:
    """Send a streaming completion on a raw socket and wait for its first data chunk."""
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the stream early: {received!r}"
        received += chunk
    return sock


# ---- readings of an in-process server -------------------------------------------------


def wait_all_free(server):
    deadline = time.monotonic() + 10
    while True:
        stats = server.manager.stats()
        if stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"] and stats["num_running"] == 0:
            assert stats["num_kv_blocks_shared"] == 0
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def texts_by_index(events):
    """Each choice's streamed text and finish_reason, from a stream's events ("[DONE]" last)."""
    texts, finishes = {}, {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c.get("text") or c.get("delta", {}).get("content") or "")
            if c["finish_reason"]:
                assert c["index"] not in finishes, "one finish_reason per choice"
                finishes[c["index"]] = c["finish_reason"]
    return texts, finishes
