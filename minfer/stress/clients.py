"""The soak's clients, each a loop run in its own thread until the soak's end time.

Every client records what it saw in a shared Tally: counts, latencies, and a
failure line for anything that breaks the server's promises (a 5xx, a stack
trace in a reply, wrong usage, a stalled connection left open). Standard
library only: raw sockets where the client must misbehave, http.client elsewhere.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)
    health_ms: list = field(default_factory=list)
    finished: list = field(default_factory=list)  # (request body, text) of each seeded stream that finished
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)


@dataclass
class Target:
    host: str
    port: int
    stall_limit: float  # seconds a stalled or idle connection may stay open before the soak calls it a failure
    max_prompt_tokens: int = 40
    max_tokens: int = 96
    long_tokens: int = 460  # a stream long enough to fill the socket buffers of a client that stops reading
    slow_tokens: int = 120  # more events than a slow reader's 4 KiB receive window holds, short enough to end

    def connection(self, timeout: float = 120.0, rcvbuf: int | None = None) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        if rcvbuf:  # a small receive window, so the server's writes wait on this client's reading
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.settimeout(timeout)
            sock.connect((self.host, self.port))
            conn.sock = sock
        return conn

    def raw(self, timeout: float = 30.0) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=timeout)


def stream_body(rng: random.Random, target: Target, max_tokens: int | None = None) -> dict:
    """A streaming completion whose usage is known in advance: token-id prompt, ignore_eos, fixed length.
    Half are greedy, half sampled with a seed (replayable)."""
    longest = 8 if max_tokens else target.max_prompt_tokens  # a long stream still fits a 512-token context
    prompt = [rng.randrange(256) for _ in range(rng.randint(1, longest))]  # byte tokens: in any GPT-2 vocabulary
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens or rng.randint(4, target.max_tokens),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if rng.random() < 0.5:
        body.update(temperature=0.9, top_p=0.95, seed=rng.randrange(2**31))
    else:
        body["temperature"] = 0
    if not max_tokens and rng.random() < 0.3:  # parallel samples of one prompt, sharing its blocks
        body["n"] = rng.randint(2, 4)
    if rng.random() < 0.3:  # the sampling controls, on the batched logits beside plain rows
        body.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.05,
                    logit_bias={str(rng.randrange(256)): 2.0})
    return body


def run_stream(
    target: Target, body: dict, tally: Tally, cancel_after: int | None = None, rcvbuf=None, line_delay: float = 0.0,
    until: float | None = None,
) -> str | None:
    """One streaming request; checks its framing and usage. Returns its text if it finished, else None. A
    stream still open at `until` (the soak's end) is closed there: the load lasts what was asked."""
    conn = target.connection(rcvbuf=rcvbuf)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            check_error_reply(tally, "stream", resp.status, resp.read())
            return None
        events = []
        while line := resp.readline():
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
                if cancel_after is not None and len(events) >= cancel_after:
                    tally.count("streams cancelled")
                    return None
                if until is not None and time.monotonic() > until:
                    tally.count("streams cut at the end of the load")
                    return None
            time.sleep(line_delay)
    except OSError as e:
        tally.fail(f"stream: {type(e).__name__}: {e}")
        time.sleep(0.2)  # no hot loop against a server that is gone
        return None
    finally:
        conn.close()
    return check_stream(tally, body, events)


def check_stream(tally: Tally, body: dict, events: list[bytes]) -> str | None:
    if not events or events[-1] != b"[DONE]":
        tally.fail(f"stream ended without [DONE]: {events[-2:]}")
        return None
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        tally.fail(f"stream got an error event: {[c for c in chunks if 'error' in c][0]}")
        return None
    usage = chunks[-1].get("usage") or {}
    n = body.get("n", 1)
    want = {
        "prompt_tokens": len(body["prompt"]),
        "completion_tokens": n * body["max_tokens"],  # every choice's tokens
        "total_tokens": len(body["prompt"]) + n * body["max_tokens"],
    }
    if {k: usage.get(k) for k in want} != want:
        tally.fail(f"stream usage {usage} != {want}")
    choices = [c for chunk in chunks for c in chunk["choices"]]
    finishes = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
    if finishes != dict.fromkeys(range(n), "length"):
        tally.fail(f"stream finish_reasons {finishes} != 'length' for each of {n} choices")
    tally.count("streams finished")
    tally.count("streams with n > 1 finished" if n > 1 else "streams with n = 1 finished")
    tally.count("tokens streamed", n * body["max_tokens"])
    texts = ["".join(c["text"] for c in choices if c["index"] == i) for i in range(n)]
    return "\x00".join(texts)  # each choice's text, in index order


def check_error_reply(tally: Tally, what: str, status: int, payload: bytes) -> None:
    if status >= 500:
        tally.fail(f"{what}: got {status}: {payload[:200]!r}")
    if b"Traceback" in payload:
        tally.fail(f"{what}: a stack trace in the reply: {payload[:200]!r}")


# ---- the client loops ----------------------------------------------------------------


def streamer(target: Target, tally: Tally, end: float, seed: int, cancel_rate: float = 0.2) -> None:
    """Stream after stream; a fifth cancel after a few events (the server must discard and free them)."""
    rng = random.Random(seed)
    while time.monotonic() < end:
        body = stream_body(rng, target)
        cancel = rng.randint(1, body["max_tokens"]) if rng.random() < cancel_rate else None
        text = run_stream(target, body, tally, cancel_after=cancel, until=end)
        if text is not None and "seed" in body:
            with tally.lock:
                tally.finished.append((body, text))


def slow_reader(target: Target, tally: Tally, end: float, seed: int) -> None:
    """Streams read a line at a time with a tiny receive window: slow, but never cut off."""
    rng = random.Random(seed)
    while time.monotonic() < end:
        body = stream_body(rng, target, target.slow_tokens)
        if run_stream(target, body, tally, rcvbuf=4096, line_delay=0.002, until=end):
            tally.count("slow streams finished")


def stopped_reader(target: Target, tally: Tally, end: float, seed: int, pause: float) -> None:
    """A long stream whose client reads the headers, then nothing for `pause` s: the server must end it."""
    rng = random.Random(seed)
    while time.monotonic() < end:
        conn = None
        try:
            conn = target.connection(timeout=30, rcvbuf=4096)
            conn.request("POST", "/v1/completions", body=json.dumps(stream_body(rng, target, target.long_tokens)))
            resp = conn.getresponse()
            check_error_reply(tally, "stopped reader", resp.status, b"")
            if resp.status != 200:  # refused under load (429): no stream to stop reading, and http.client
                resp.read()  # has already let go of the socket (the reply said Connection: close)
                tally.count(f"stopped readers refused with {resp.status}")
                continue
            time.sleep(pause)
            conn.sock.settimeout(target.stall_limit)
            data = resp.read()  # what the buffers held, then the end: a stream cut short raises IncompleteRead
            tally.count(
                "stopped readers whose stream fit in the socket buffers"
                if b"[DONE]" in data
                else "stopped readers cut off"
            )
        except (http.client.IncompleteRead, ConnectionError):
            tally.count("stopped readers cut off")
        except TimeoutError:  # generation under load is slower than the pause: the buffers never filled
            tally.count("stopped readers whose stream was too slow to fill the buffers")
        except OSError as e:
            tally.fail(f"stopped reader: {type(e).__name__}: {e}")
        finally:
            if conn:
                conn.close()


def wait_closed(target: Target, tally: Tally, sock: socket.socket, what: str, opened: float) -> bytes:
    """Read until the server closes; a failure if it holds the connection past the stall limit."""
    sock.settimeout(max(0.1, opened + target.stall_limit - time.monotonic()))
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        tally.fail(f"{what} connection still open after {target.stall_limit:g} s")
        return data
    except ConnectionError:
        pass
    tally.count(f"{what} connections closed by the server")
    return data


def idler(target: Target, tally: Tally, end: float, seed: int) -> None:
    """Alternately: a connection that never sends a byte, and one that sends a request and then idles."""
    kept = seed % 2 == 0
    while time.monotonic() < end:
        opened = time.monotonic()
        try:
            with target.raw() as sock:
                if kept:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = wait_closed(target, tally, sock, "idle" if kept else "silent", opened)
        except OSError as e:
            tally.fail(f"idle client: {type(e).__name__}: {e}")
            time.sleep(0.5)
            continue
        if kept and not data.startswith(b"HTTP/1.1 200"):
            tally.fail(f"idle client: /health answered {data[:100]!r}")
        kept = not kept


def staller(target: Target, tally: Tally, end: float, seed: int) -> None:
    """Headers with a Content-Length, then only part of the body: the server must send 408 and close."""
    rng = random.Random(seed)
    while time.monotonic() < end:
        opened = time.monotonic()
        partial = b'{"prompt": "Hello", "max_tok'[: rng.randint(0, 28)]
        try:
            with target.raw() as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 200\r\n\r\n" + partial
                )
                data = wait_closed(target, tally, sock, "stalled", opened)
        except OSError as e:
            tally.fail(f"stalled client: {type(e).__name__}: {e}")
            time.sleep(0.5)
            continue
        if not data.startswith(b"HTTP/1.1 408"):
            tally.fail(f"stalled client got {data[:60]!r}, not 408")


def prober(target: Target, tally: Tally, end: float, path: str, interval: float) -> None:
    """GET /health (timed) or /metrics (parsed) on a fresh connection every `interval` s."""
    while time.monotonic() < end:
        start = time.monotonic()
        conn = target.connection(timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            payload = resp.read()
        except OSError as e:
            tally.fail(f"{path}: {type(e).__name__}: {e}")
            time.sleep(interval)
            continue
        finally:
            conn.close()
        took = time.monotonic() - start
        check_error_reply(tally, path, resp.status, payload)
        if path == "/health":
            with tally.lock:
                tally.health_ms.append(took * 1000)
        else:
            parse_metrics(payload.decode())  # raises on a malformed exposition
        tally.count(f"{path} requests")
        time.sleep(max(0.0, interval - took))


def parse_metrics(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in "#")}
