"""Online mode: streaming `POST /v1/completions` from client threads to an OpenAI-compatible server.

`ServerProcess` starts `python -m minfer.serve` on a free port (--port 0) and stops it with
SIGTERM afterwards; any other server (vLLM, llama.cpp's server, ...) is measured
the same way through its base URL. One thread per request sends it at its arrival
time (a semaphore enforces --max-concurrency: the request is sent, and its clock
starts, when a slot frees up) and timestamps every streamed chunk that carries text.
A chunk's text may hold more than one token, and a token may produce no text (half
a UTF-8 character), so online ITL is the gap between *text chunks*; the exact output
token count comes from the final usage chunk (stream_options.include_usage).
vLLM's benchmark also times chunks with empty text; minfer.serve sends one only to
carry finish_reason, right after the last text, where it would add a ~0 ms "gap".
A server that sends no usage gets vLLM's count instead: its text, every choice's, tokenized
(with no tokenizer at hand, its text chunks: fewer than its tokens where a chunk holds several).

For a trace, `EngineFeedReader` also reads minfer.serve's /engine/events while the run
goes on, so the trace gets the engine's per-step counters (other servers lack the feed).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from tqdm import tqdm

from .metrics import RequestRecord, RunResult
from .workload import BenchRequest


class Endpoint:
    """Where the server listens; `base_url` like http://127.0.0.1:8000 (a trailing /v1 is fine)."""

    def __init__(self, base_url: str, timeout: float = 600.0):
        url = urlsplit(base_url if "://" in base_url else "http://" + base_url)
        try:
            port = url.port
        except ValueError:  # no number, or past 65535
            port = -1
        if url.scheme not in ("http", "https") or not url.hostname or port == -1:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {base_url!r}")
        self.https = url.scheme == "https"
        self.host, self.port = url.hostname, port
        self.prefix = url.path.rstrip("/").removesuffix("/v1")
        self.timeout = timeout

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout or self.timeout)

    def get_json(self, path: str, timeout: float = 5.0) -> dict:
        conn = self.connect(timeout)
        try:
            conn.request("GET", self.prefix + path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"GET {path}: HTTP {resp.status}")
            return json.loads(body or b"{}")
        finally:
            conn.close()

    def served_model(self, wanted: str) -> str:
        """`wanted` if GET /v1/models lists it (or cannot be asked), else the first model listed:
        what the server expects in "model" (minfer.serve calls a local model by its path)."""
        try:
            names = [m["id"] for m in self.get_json("/v1/models")["data"]]
        except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException):
            return wanted
        return wanted if wanted in names or not names else names[0]


class ServerProcess:
    """`python -m minfer.serve` in a subprocess, for the duration of a `with` block."""

    def __init__(self, model_dir, server_args: list[str], startup_timeout: float = 300.0):
        self.command = [sys.executable, "-m", "minfer.serve", "--model", str(model_dir), *server_args]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        # Port 0: the server binds any free port and prints where it listens, so no race for a port.
        # Its output goes to a file opened for appending, so reading it here never moves its writes.
        fd, self.log_path = tempfile.mkstemp(prefix="minfer-serve-", suffix=".log")
        os.close(fd)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.command, "--port", "0"], stdout=log, stderr=subprocess.STDOUT)
        try:
            self.endpoint = Endpoint(self._wait_for_address())
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ChildProcessError(f"minfer.serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
        if time.monotonic() > self.deadline:
            raise ChildProcessError(f"minfer.serve not ready after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def _wait_for_address(self) -> str:
        """The URL from the server's 'serving ... on http://HOST:PORT' line."""
        self.deadline = time.monotonic() + self.startup_timeout
        while True:
            self._check_alive()
            found = re.search(r"https?://[^\s/]+:\d+", self.log_tail(100_000))
            if found:
                return found.group(0)
            time.sleep(0.05)

    def _wait_healthy(self) -> None:
        while True:
            self._check_alive()
            try:
                self.endpoint.get_json("/health", timeout=2.0)
                return
            except (OSError, ValueError, http.client.HTTPException):
                time.sleep(0.05)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def peak_rss_mib(self) -> float | None:
        """The server's own high-water RSS (Linux /proc); None where unavailable."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            return kib / 1024
        except (OSError, StopIteration, ValueError):
            return None

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)


class EngineFeedReader:
    """Keeps the step events of a server's /engine/events feed, read in a background thread.
    A server without the feed (404, or unreachable) gives no steps."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.events: list[dict] = []  # step events, in order (appended by the reader thread only)
        self.conn = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> "EngineFeedReader":
        try:
            self.conn = self.endpoint.connect(timeout=None)
            self.conn.request("GET", self.endpoint.prefix + "/engine/events")
            resp = self.conn.getresponse()
        except (OSError, http.client.HTTPException):
            return self
        if resp.status == 200:
            self.thread = threading.Thread(target=self._read, args=(resp,), daemon=True)
            self.thread.start()
        return self

    def _read(self, resp) -> None:
        try:
            for line in resp:
                if line.startswith(b"data:"):
                    self.events += [e for e in json.loads(line[5:]) if e["type"] == "step"]
        except (OSError, ValueError, http.client.HTTPException):
            pass  # closed by __exit__, or the server went away

    def steps(self, t0_wall: float, t_end_wall: float) -> list[dict]:
        """The steps that began in [t0_wall, t_end_wall], as dicts of StepStats fields (scheduler.last_step),
        times in seconds since t0_wall (the feed's times are wall-clock: the server is another process)."""
        time.sleep(0.2)  # the feed sends at most 20 messages a second: let the last one arrive
        return [
            {
                "start": e["start"] - t0_wall,
                "end": e["end"] - t0_wall,
                "num_seqs": e["num_seqs"],
                "num_prefill_tokens": e["num_prefill_tokens"],
                "num_decode_tokens": e["num_decode_tokens"],
                "num_preemptions": len(e["preempted"]),
                "kv_blocks_used": e["kv_blocks_used"],
            }
            for e in list(self.events)
            if t0_wall <= e["start"] <= t_end_wall
        ]

    def __exit__(self, *exc) -> None:
        if self.thread is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)  # ends the reader thread's blocking read
            self.thread.join()
        if self.conn is not None:
            self.conn.close()


def stream_completion(endpoint: Endpoint, model: str, r: BenchRequest, t0: float, n: int = 1,
                      count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """Send one streaming completion and time its chunks (seconds since t0). With n > 1, seeded sampling
    (n greedy choices would be one), and the chunks of choice 0 timed. count_tokens: a text's token count, for a
    server that sends no usage."""
    rec = RequestRecord(r.index, r.input_len, n * r.output_len, num_choices=n)
    fields = {"temperature": 0.0} if n == 1 else {"temperature": 1.0, "seed": r.index, "n": n}
    body = json.dumps(
        {
            "model": model,
            "prompt": r.prompt_token_ids if r.prompt_token_ids is not None else r.prompt,
            "max_tokens": r.output_len,
            **fields,
            "ignore_eos": True,  # an extension vLLM and minfer share: exactly max_tokens tokens
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"logprobs": r.logprobs} if r.logprobs is not None else {}),
            **({"structured_outputs": r.structured_outputs} if r.structured_outputs else {}),
        }
    )
    conn = endpoint.connect()
    usage, num_chunks, last, done, ended = None, 0, None, False, set()  # ended: the choices with a finish_reason
    texts: dict[int, list[str]] = {}  # every choice's text pieces, to count its tokens where usage is missing
    try:
        rec.submit_time = time.perf_counter() - t0
        conn.request("POST", endpoint.prefix + "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
        while line := resp.readline():
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            msg = completion_chunk(data)
            usage = msg.get("usage") or usage
            choices = msg.get("choices") or []
            ended |= {c.get("index", 0) for c in choices if c.get("finish_reason")}
            for c in choices:
                if isinstance(c.get("text"), str) and c["text"]:
                    texts.setdefault(c.get("index", 0), []).append(c["text"])
            if any(c.get("text") and c.get("index", 0) == 0 for c in choices):
                now = time.perf_counter() - t0
                if last is None:
                    rec.first_token_time = now
                else:
                    rec.itl.append(now - last)
                last = now
                num_chunks += 1
        if not done and len(ended) < n:  # a server that goes away ends the body early: no whole answer
            raise OSError(f"the stream ended before its finish_reason or [DONE] ({num_chunks} text chunks read)")
        if last is None:
            raise OSError("the stream ended without a single choice")
        rec.finish_time = last
        if usage is not None:
            rec.output_len = token_count(usage, "completion_tokens")
        elif count_tokens is not None:
            rec.output_len = sum(count_tokens("".join(pieces)) for pieces in texts.values())
        else:
            rec.output_len = sum(map(len, texts.values()))
        if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
            rec.input_len = token_count(usage, "prompt_tokens")
    except (OSError, ValueError, http.client.HTTPException) as e:
        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
        rec.finish_time = time.perf_counter() - t0
    finally:
        conn.close()
    return rec


def completion_chunk(data: bytes) -> dict:
    """One streamed chunk: a JSON object whose choices (if any) are a list of objects. OSError for an error
    the server streams, ValueError for anything else that is no completion chunk."""
    msg = json.loads(data)
    if isinstance(msg, dict) and "error" in msg:
        raise OSError(f"error in stream: {msg['error']}")
    choices = msg.get("choices") or [] if isinstance(msg, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ValueError(f"a stream chunk is not an OpenAI completion chunk: {data[:200].decode(errors='replace')}")
    return msg


def token_count(usage, key: str) -> int:
    """usage[key], a count of tokens; ValueError naming what the server sent instead."""
    count = usage.get(key) if isinstance(usage, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"the stream's usage holds no {key} count: {usage!r}")
    return count


def run_online(
    endpoint: Endpoint,
    model: str,
    requests: list[BenchRequest],
    max_concurrency: int | None = None,
    progress: bool = True,
    desc: str = "online",
    feed: EngineFeedReader | None = None,
    n: int = 1,
    count_tokens: Callable[[str], int] | None = None,
) -> RunResult:
    slots = threading.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    lock = threading.Lock()
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress)

    def client(r: BenchRequest) -> None:
        try:
            try:
                rec = stream_completion(endpoint, model, r, t0, n, count_tokens)
            except Exception as e:  # a reply no check foresaw: one failed request, never a lost one
                rec = RequestRecord(r.index, r.input_len, n * r.output_len, num_choices=n, success=False,
                                    error=f"{type(e).__name__}: {e}")
            with lock:
                records.append(rec)
                bar.update(1)
        finally:
            if slots:
                slots.release()

    threads = []
    t0, t0_wall = time.perf_counter(), time.time()
    for r in sorted(requests, key=lambda r: r.arrival):
        time.sleep(max(0.0, r.arrival - (time.perf_counter() - t0)))
        if slots:
            slots.acquire()
        threads.append(threading.Thread(target=client, args=(r,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - t0
    bar.close()
    steps = feed.steps(t0_wall, t0_wall + duration) if feed else []
    return RunResult(sorted(records, key=lambda r: r.index), duration, steps)


def refuse_if_all_failed(result: RunResult, endpoint: Endpoint) -> None:
    """A run with no successful request measures nothing: say why instead of printing a table of n/a."""
    failed = [r for r in result.records if not r.success]
    if failed and len(failed) == len(result.records):
        raise OSError(f"every request to {endpoint.host}:{endpoint.port} failed, the first with {failed[0].error}")


def failures_line(result: RunResult) -> str | None:
    """One line for a run some of whose requests failed (None if none did): how many, and the first one's why."""
    failed = [r for r in result.records if not r.success]
    if not failed:
        return None
    return f"{len(failed)} of {len(result.records)} requests failed, the first with {failed[0].error}"
