"""A Chrome / Perfetto trace of one run: open it in ui.perfetto.dev (or chrome://tracing).

Process "requests" has one track per request, with its spans:
    queued   submitted -> the start of the first engine step that ran it
    prefill  that step's start -> first token (all chunks of a chunked prefill, and
             any wait between them)
    decode   first token -> last token
A request that is preempted keeps these three spans; its args count the preemptions.
Online, the client cannot tell when the engine first ran a request, so queued and
prefill merge into one span, "queued+prefill" (submit -> first streamed chunk).

Process "engine" has a "step" span per scheduler step (online: read from the
server's /engine/events feed, so minfer.serve only) and counters sampled at each
step's start: batch size, prefill vs decode tokens, KV blocks in use, preemptions. Watching the batch
grow and shrink as requests come and go is continuous batching.
"""

from __future__ import annotations

import json
from pathlib import Path

from .metrics import RequestRecord

REQUESTS_PID, ENGINE_PID = 1, 2


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _span(name: str, pid: int, tid: int, start: float, end: float, args: dict | None = None) -> dict:
    event = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start), "dur": _us(max(end - start, 0))}
    if args:
        event["args"] = args
    return event


def _counters(ts: float, step: dict) -> list[dict]:
    values = {
        "batch size": {"seqs": step["num_seqs"]},
        "tokens": {"prefill": step["num_prefill_tokens"], "decode": step["num_decode_tokens"]},
        "kv blocks in use": {"blocks": step["kv_blocks_used"]},
        "preemptions": {"preemptions": step["num_preemptions"]},
    }
    return [{"name": name, "ph": "C", "pid": ENGINE_PID, "ts": _us(ts), "args": args} for name, args in values.items()]


def _names(pid: int, process: str, threads: dict[int, str]) -> list[dict]:
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}}]
    for tid, name in threads.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def build_trace(records: list[RequestRecord], steps: list[dict], metadata: dict | None = None) -> dict:
    """Times in records and steps are seconds since the run started; the trace is in microseconds."""
    events = _names(REQUESTS_PID, "requests", {r.index + 1: f"request {r.index}" for r in records})
    for r in records:
        tid = r.index + 1
        args = {
            "input_len": r.input_len,
            "output_len": r.output_len,
            "num_preemptions": r.num_preemptions,
            "num_cached_tokens": r.num_cached_tokens,
        }
        if r.first_token_time is None:  # failed before its first token
            events.append(
                _span(
                    "failed",
                    REQUESTS_PID,
                    tid,
                    r.submit_time,
                    r.finish_time or r.submit_time,
                    {**args, "error": r.error},
                )
            )
            continue
        if r.scheduled_time is not None:
            events.append(_span("queued", REQUESTS_PID, tid, r.submit_time, r.scheduled_time, args))
            events.append(_span("prefill", REQUESTS_PID, tid, r.scheduled_time, r.first_token_time, args))
        else:
            events.append(_span("queued+prefill", REQUESTS_PID, tid, r.submit_time, r.first_token_time, args))
        events.append(_span("decode", REQUESTS_PID, tid, r.first_token_time, r.finish_time, args))
    if steps:
        events += _names(ENGINE_PID, "engine", {1: "scheduler steps"})
    for s in steps:
        args = {k: s[k] for k in ("num_seqs", "num_prefill_tokens", "num_decode_tokens", "kv_blocks_used")}
        events.append(_span("step", ENGINE_PID, 1, s["start"], s["end"], args))
        events += _counters(s["start"], s)
    if steps:  # bring every counter back to zero when the work is done
        idle = {
            "num_seqs": 0,
            "num_prefill_tokens": 0,
            "num_decode_tokens": 0,
            "kv_blocks_used": 0,
            "num_preemptions": 0,
        }
        events += _counters(steps[-1]["end"], idle)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}


def write_trace(path: str | Path, records: list[RequestRecord], steps: list[dict], metadata: dict | None = None):
    Path(path).write_text(json.dumps(build_trace(records, steps, metadata)))
