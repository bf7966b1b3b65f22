"""The soak: every client of clients.py and malformed.py at once, then the checks, replays, and SIGTERM."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..checkpoints.chat_tokenizers import CHATML_TOOLS_TEMPLATE
from .clients import (
    Tally,
    Target,
    check_error_reply,
    idler,
    parse_metrics,
    prober,
    run_stream,
    slow_reader,
    staller,
    stopped_reader,
    streamer,
)
from .constrained import constrained
from .malformed import BAD_REQUESTS, malformer
from .scorer import scorer

SPAWN_TIMEOUTS = 2.0  # the spawned server's request, keep-alive and write timeouts: short, so they fire in a run
SHUTDOWN_GRACE = 3.0  # what `python -m minfer.serve` gives handlers to write their last bytes on SIGTERM


@dataclass
class SoakConfig:
    duration: float = 60.0  # seconds of load
    streams: int = 64  # concurrent streaming clients (a fifth of their streams cancel midway)
    idle: int = 16  # connections that send nothing, or one request and then nothing
    stalled: int = 8  # requests whose body never arrives
    slow: int = 4  # streams read slowly through a tiny receive window
    stopped: int = 2  # streams whose client stops reading
    scorers: int = 6  # clients sending what eval harnesses send: echo + logprobs batches, logprob streams
    constrained: int = 4  # clients asking for structured outputs: regexes, choices, JSON schemas, grammars
    replays: int = 16  # seeded streams replayed alone afterwards
    health_p99_ms: float = 2000.0  # generous: a loaded 2-core machine is slow, but not this slow
    max_rss_growth_mib: float = 128.0
    stall_limit: float = 45.0  # seconds a stalled or idle connection may stay open (server timeouts + slack)
    write_timeout: float = 30.0  # the server's; stopped readers pause a little longer than this
    seed: int = 0
    # The spawned server's extra engine flags: ("--speculative-method", "ngram") mixes speculating requests
    # (seeded ones speculate in any batch, the others when few run) into the load.
    server_args: tuple[str, ...] = ()
    # Whether a seeded stream replayed alone must give exactly its text under load. A server in float32 or
    # bf16 rounds logits a little differently in another batch, which changes about one sampled token in
    # 6,000 (docs/sampling.md); the spawned server runs float64, where it does not, so any difference
    # there is a bug. Off for a server of someone else's: differences are then counted, not failed.
    exact_replays: bool = True


def get_metrics(target: Target) -> dict[str, float]:
    conn = target.connection(timeout=30)
    try:
        conn.request("GET", "/metrics")
        return parse_metrics(conn.getresponse().read().decode())
    finally:
        conn.close()


def soak(target: Target, cfg: SoakConfig, tally: Tally, progress: Callable[[str], None] | None = None) -> dict:
    """Run every client for cfg.duration seconds, wait for the server to settle, replay; return the figures.
    `progress`, if given, hears a line about every tenth of the duration while the load runs."""
    before = get_metrics(target)
    start = time.monotonic()
    end = start + cfg.duration
    jobs = [(streamer, i, ()) for i in range(cfg.streams)] + [(idler, i, ()) for i in range(cfg.idle)]
    jobs += [(staller, i, ()) for i in range(cfg.stalled)] + [(slow_reader, i, ()) for i in range(cfg.slow)]
    jobs += [(stopped_reader, i, (cfg.write_timeout + 2,)) for i in range(cfg.stopped)] + [(malformer, 0, ())]
    jobs += [(scorer, i, ()) for i in range(cfg.scorers)] + [(constrained, i, ()) for i in range(cfg.constrained)]
    threads = [
        threading.Thread(target=fn, args=(target, tally, end, cfg.seed * 1000 + i, *extra), daemon=True)
        for fn, i, extra in jobs
    ]
    threads += [
        threading.Thread(target=prober, args=(target, tally, end, "/health", 0.1), daemon=True),
        threading.Thread(target=prober, args=(target, tally, end, "/metrics", 0.5), daemon=True),
    ]
    if progress is not None:
        threads.append(threading.Thread(target=reporter, args=(tally, start, end, progress), daemon=True))
    for t in threads:
        t.start()
    time.sleep(cfg.duration / 4)  # RSS once the server has warmed up (threads, allocator, caches)
    rss_warm = get_metrics(target).get("process_resident_memory_bytes", 0)
    for t in threads:
        t.join(max(1.0, end + cfg.stall_limit + 120 - time.monotonic()))
        if t.is_alive():
            tally.fail(f"client {t.name} did not finish")
    load_seconds = time.monotonic() - start

    after = settled(target, tally)
    matched = replay(target, cfg, tally)
    health = sorted(tally.health_ms) or [0.0]
    p99 = health[min(len(health) - 1, int(0.99 * len(health)))]
    if p99 > cfg.health_p99_ms:
        tally.fail(f"/health p99 {p99:.0f} ms > {cfg.health_p99_ms:g} ms")
    growth = (after.get("process_resident_memory_bytes", 0) - rss_warm) / 2**20
    if growth > cfg.max_rss_growth_mib:
        tally.fail(f"RSS grew {growth:.0f} MiB after warm-up (limit {cfg.max_rss_growth_mib:g})")
    c = tally.counts
    return {
        "load seconds": round(load_seconds, 1),
        "concurrent streams": cfg.streams,
        "streams finished": c["streams finished"],
        "of them with n > 1 choices": c["streams with n > 1 finished"],
        "streams cancelled midway": c["streams cancelled"],
        "tokens streamed": c["tokens streamed"],
        "streams cut at the end of the load": c["streams cut at the end of the load"],
        "preemptions": grew(before, after, "minfer_preemptions_total"),
        "speculative proposals accepted": grew(before, after, "minfer_spec_decode_num_accepted_tokens_total"),
        "requests discarded by the server": grew(before, after, "minfer_requests_aborted_total"),
        "slow-reader streams finished": c["slow streams finished"],
        "scoring requests answered (echo + logprobs)": c["scoring requests answered"],
        "prompts scored": c["prompts scored"],
        "scoring requests refused with 429": c["scoring requests refused with 429"],
        "logprob streams finished": c["logprob streams finished"],
        "constrained requests answered": c["constrained requests answered"],
        "constrained outputs that stopped (each meets its constraint)": c["constrained outputs ending with stop"],
        "constrained outputs cut at max_tokens": c["constrained outputs ending with length"],
        "tool requests answered": c["tool requests answered"],
        "tool requests refused: the chat template renders no tools": c[
            "tool requests refused: the chat template renders no tools"
        ],
        "tool calls returned (each naming a tool, its arguments valid)": c["tool calls returned"],
        "stopped readers cut off": c["stopped readers cut off"],
        "stopped readers whose stream fit in the socket buffers": c[
            "stopped readers whose stream fit in the socket buffers"
        ],
        "stopped readers whose stream was too slow to fill them": c[
            "stopped readers whose stream was too slow to fill the buffers"
        ],
        **{
            f"server {kind} timeouts": grew(before, after, f'minfer_http_timeouts_total{{kind="{kind}"}}')
            for kind in ("request", "idle", "write")
        },
        "idle keep-alive connections closed": c["idle connections closed by the server"],
        "silent connections closed": c["silent connections closed by the server"],
        "stalled requests closed with 408": c["stalled connections closed by the server"],
        "malformed requests answered 4xx": c["malformed requests answered 4xx"],
        "kinds of bad input tried": sum(1 for name, _, _ in BAD_REQUESTS if c[f"bad input: {name}"]),
        "/metrics scrapes": c["/metrics requests"],
        "/health probes": len(tally.health_ms),
        "/health p50 ms": round(health[len(health) // 2], 1),
        "/health p99 ms": round(p99, 1),
        "RSS after warm-up MiB": round(rss_warm / 2**20),
        "RSS growth since MiB": round(growth, 1),
        "seeded streams replayed alone, identical": f"{matched}/{min(cfg.replays, len(tally.finished))}",
        "KV blocks free at the end": f"{after['minfer_kv_blocks_free']:.0f}/{after['minfer_kv_blocks_total']:.0f}",
    }


def grew(before: dict, after: dict, name: str) -> int:
    """How much a counter of /metrics grew over the load: a count, so an integer."""
    return int(after.get(name, 0) - before.get(name, 0))


def reporter(tally: Tally, start: float, end: float, say: Callable[[str], None]) -> None:
    """A line about every tenth of the load (at least every 5 s): what has happened so far."""
    every = max(5.0, (end - start) / 10)
    while time.monotonic() + every < end:
        time.sleep(every)
        c = tally.counts
        say(f"[{time.monotonic() - start:5.0f} s of {end - start:.0f}] streams finished {c['streams finished']}, "
            f"cancelled {c['streams cancelled']}, tokens {c['tokens streamed']}, failures {len(tally.failures)}")


def settled(target: Target, tally: Tally, timeout: float = 30.0) -> dict:
    """Wait until nothing runs or waits, every block is free and only our scrape's connection is open."""
    deadline = time.monotonic() + timeout
    while True:
        m = get_metrics(target)
        idle = m["minfer_requests_running"] == 0 and m["minfer_requests_waiting"] == 0
        free = m["minfer_kv_blocks_free"] == m["minfer_kv_blocks_total"]
        if idle and free and m.get("minfer_http_connections_open", 1) <= 1:
            return m
        if time.monotonic() > deadline:
            tally.fail(f"not settled {timeout:g} s after the load: {json.dumps(m)[:600]}")
            return m
        time.sleep(0.1)


def replay(target: Target, cfg: SoakConfig, tally: Tally) -> int:
    """Seeded streams, run again one at a time, must give the text they gave under load (cfg.exact_replays)."""
    picked = random.Random(cfg.seed).sample(tally.finished, min(cfg.replays, len(tally.finished)))
    matched = 0
    for body, text in picked:
        again = run_stream(target, body, Tally())
        if again == text:
            matched += 1
        elif cfg.exact_replays:
            tally.fail(f"seeded stream differs when replayed alone: {body}")
    return matched


# ---- a server of our own, and SIGTERM in the middle of a soak --------------------------


class ServerDidNotStart(RuntimeError):
    """minfer.serve exited before listening (a bad --model, say); the message holds its log's tail."""


def spawn_server(model: str, kv_blocks: int, log_path: str, server_args=()) -> tuple[subprocess.Popen, int]:
    t = str(SPAWN_TIMEOUTS)
    cmd = [
        sys.executable,
        "-m",
        "minfer.serve",
        "--model",
        model,
        "--port",
        "0",
        "--num-kv-blocks",
        str(kv_blocks),
        "--dtype",  # seeded replays are then exact (SoakConfig.exact_replays)
        "float64",
        "--request-timeout",
        t,
        "--keepalive-timeout",
        t,
        "--write-timeout",
        t,
        *server_args,
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()  # "minfer: serving ... on http://127.0.0.1:PORT ..." once it listens
    if "serving" not in line:
        proc.kill()
        raise ServerDidNotStart(f"the server did not start: {open(log_path).read()[-2000:].strip()}")
    return proc, int(line.rsplit(":", 1)[1].split()[0])


def sigterm_midstream(target: Target, proc: subprocess.Popen, cfg: SoakConfig, tally: Tally, n: int = 16) -> dict:
    """Load again, then SIGTERM: exit 0 within the grace period, every open stream ends with an error and [DONE]."""
    background = Tally()  # the chaos clients only keep the server busy; their errors once it is gone don't count
    end = time.monotonic() + 10  # past the signal; the server is gone by then
    for fn in [streamer] * 16 + [idler, staller, malformer]:
        threading.Thread(target=fn, args=(target, background, end, cfg.seed + 7), daemon=True).start()
    rng = random.Random(cfg.seed + 1)
    streams = []
    for _ in range(n):
        conn = target.connection(timeout=30)
        body = {
            "prompt": [rng.randrange(256) for _ in range(4)],
            "max_tokens": target.long_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        resp = conn.getresponse()
        if resp.status != 200:
            check_error_reply(tally, "sigterm stream", resp.status, resp.read())
            continue
        streams.append((conn, resp))
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    ended = 0
    for conn, resp in streams:
        try:
            events = [line[6:].strip() for line in resp if line.startswith(b"data: ")]
        except OSError as e:
            tally.fail(f"SIGTERM: a stream broke off instead of ending: {e}")
            continue
        finally:
            conn.close()
        if events[-1:] == [b"[DONE]"] and len(events) >= 2 and b'"error"' in events[-2]:
            ended += 1
        elif events[-1:] == [b"[DONE]"] and b'"finish_reason": "length"' in b"".join(events):
            ended += 1  # it finished before the signal reached it
        else:
            tally.fail(f"SIGTERM: a stream ended without an error event and [DONE]: {events[-2:]}")
    try:
        code = proc.wait(SHUTDOWN_GRACE + 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "hung"
    took = time.monotonic() - sent
    if code != 0 or took > SHUTDOWN_GRACE + 2:
        tally.fail(f"SIGTERM: exit code {code} after {took:.1f} s (grace {SHUTDOWN_GRACE:g} s)")
    return {
        "streams open at SIGTERM": len(streams),
        "streams ended with an error event and [DONE]": ended,
        "exit code after SIGTERM": code,
        "seconds from SIGTERM to exit": round(took, 1),
    }


def run_spawned(
    model: str, cfg: SoakConfig, kv_blocks: int = 48, tally: Tally | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, Tally]:
    """Start a server with few KV blocks and short timeouts, soak it, SIGTERM it mid-load, read its log."""
    tally = tally or Tally()
    cfg.stall_limit = SPAWN_TIMEOUTS + 8.0
    cfg.write_timeout = SPAWN_TIMEOUTS
    log_path = os.path.join(tempfile.mkdtemp(prefix="minfer-stress-"), "server.log")
    template = os.path.join(os.path.dirname(log_path), "tools.jinja")  # so that tool requests have a template
    with open(template, "w") as f:
        f.write(CHATML_TOOLS_TEMPLATE)
    proc, port = spawn_server(model, kv_blocks, log_path, ("--chat-template", template, *cfg.server_args))
    try:
        target = Target("127.0.0.1", port, cfg.stall_limit)
        figures = {"KV blocks": kv_blocks, **soak(target, cfg, tally, progress)}
        figures.update(sigterm_midstream(target, proc, cfg, tally))
    finally:
        if proc.poll() is None:
            proc.kill()
    log = open(log_path).read()
    tracebacks = log.count("Traceback")
    if tracebacks:
        tally.fail(f"{tracebacks} stack traces in the server log {log_path}")
    if tally.failures:  # keep the log to read; a clean run leaves nothing behind in /tmp
        figures["server log"] = log_path
    else:
        shutil.rmtree(os.path.dirname(log_path), ignore_errors=True)
    figures["stack traces in the server log"] = tracebacks
    return figures, tally
