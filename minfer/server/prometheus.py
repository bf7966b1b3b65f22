"""/metrics: the server's counters (metrics.py), the scheduler's stats snapshot and the connections'
counters, in the Prometheus text exposition format."""

from __future__ import annotations

import os

from .connections import ConnectionStats
from .metrics import Histogram, Metrics

# What /metrics reads from the scheduler's stats snapshot: (metric name, type, help, key in scheduler.stats())
FROM_STATS = [
    ("requests_running", "gauge", "Requests being scheduled (holding KV blocks).", "num_running"),
    ("requests_waiting", "gauge", "Requests queued for a slot, including preempted ones.", "num_waiting"),
    ("kv_blocks_free", "gauge", "Free KV cache blocks.", "num_kv_blocks_free"),
    ("kv_blocks_total", "gauge", "KV cache blocks in all.", "num_kv_blocks_total"),
    (
        "kv_blocks_shared",
        "gauge",
        "KV cache blocks held by several sequences (a common prefix, or n samples of one prompt), each stored once.",
        "num_kv_blocks_shared",
    ),
    ("preemptions_total", "counter", "Sequences preempted to free KV blocks.", "num_preemptions"),
    (
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache (at each request's first admission).",
        "prefix_cache_hit_tokens",
    ),
    (
        "recompute_cache_hit_tokens_total",
        "counter",
        "Tokens preempted sequences found in the prefix cache when re-admitted, not recomputed (outputs too).",
        "recompute_cache_hit_tokens",
    ),
]
# Speculative decoding's counters (vLLM's spec_decode_* names), when the engine speculates.
SPEC_DECODE = [
    ("spec_decode_num_drafts_total", "Verifications: steps in which a sequence checked proposals.",
     "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens_total", "Proposed tokens verified.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens_total", "Proposed tokens accepted.", "spec_decode_num_accepted_tokens"),
]


def render(metrics: Metrics, stats: dict) -> str:
    """Prometheus text exposition; `stats` is the latest scheduler.stats() snapshot."""
    with metrics._lock:
        lines = []
        for name, kind, help_text, key in FROM_STATS:
            lines += metric("minfer_" + name, kind, help_text, stats.get(key, 0))
        if "spec_decode_num_drafts" in stats:
            lines += spec_decode_metrics(stats)
        if "num_path_fallbacks" in stats:  # compiled/forward.py: where a compiled path can fail
            help_text = "Compiled paths (attention, CUDA graphs, compiled steps) switched off for eager ones."
            lines += metric("minfer_path_fallbacks_total", "counter", help_text, stats["num_path_fallbacks"])
        for name, help_text, value in [
            ("requests_finished_total", "Requests that finished (stop or length).", metrics.finished),
            ("requests_aborted_total", "Requests discarded before finishing.", metrics.aborted),
            ("requests_rejected_total", "Requests refused because the queue was full.", metrics.rejected),
            ("prompt_tokens_total", "Prompt tokens of admitted requests.", metrics.prompt_tokens),
            ("generation_tokens_total", "Tokens generated.", metrics.generation_tokens),
        ]:
            lines += metric("minfer_" + name, "counter", help_text, value)
        for name, help_text, hist in [
            ("time_to_first_token_seconds", "Time from submission to the first generated token.", metrics.ttft),
            ("time_per_output_token_seconds", "Mean time between output tokens, per request.", metrics.tpot),
            ("e2e_request_latency_seconds", "Time from submission to the request's finish.", metrics.e2e),
        ]:
            lines += metric("minfer_" + name, "histogram", help_text, hist)
    rss = resident_memory_bytes()
    if rss is not None:  # the standard process metric's name, so dashboards find it
        lines += metric("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", rss)
    return "\n".join(lines) + "\n"


def spec_decode_metrics(stats: dict) -> list[str]:
    """The speculative-decoding counters, accepted tokens per proposal position, and the histogram of
    accepted lengths (tokens a verification emits: accepted proposals + 1; its mean is the speed-up's bound)."""
    lines = []
    for name, help_text, key in SPEC_DECODE:
        lines += metric("minfer_" + name, "counter", help_text, stats[key])
    per_pos = {f'position="{j}"': n for j, n in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"])}
    lines += metric(
        "minfer_spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted proposals by position.", per_pos
    )
    counts = stats["spec_decode_accepted_length_counts"]  # [n]: verifications that emitted n tokens
    lengths = Histogram(tuple(range(1, len(counts))))
    lengths.counts = counts[1:]
    lengths.count = sum(counts)
    lengths.sum = sum(n * c for n, c in enumerate(counts))
    return lines + metric(
        "minfer_spec_decode_accepted_length", "histogram", "Tokens each verification emitted.", lengths
    )


def metric(name: str, kind: str, help_text: str, value) -> list[str]:
    """One metric in the text format: its HELP and TYPE lines, then its sample(s). `value` is a number,
    a Histogram, or a {label text: number} dict for a labelled family (`kind="x"` -> name{kind="x"})."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    if isinstance(value, Histogram):
        return lines + histogram_lines(name, value)
    if isinstance(value, dict):
        return lines + [f"{name}{{{labels}}} {n}" for labels, n in value.items()]
    return lines + [f"{name} {value}"]


def resident_memory_bytes() -> int | None:
    """This process's resident memory (Linux's /proc), or None where that is not available."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def histogram_lines(name: str, h: Histogram) -> list[str]:
    lines, total = [], 0
    for bound, n in zip(h.buckets, h.counts):
        total += n
        lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
    lines.append(f"{name}_sum {h.sum}")
    lines.append(f"{name}_count {h.count}")
    return lines


def connection_lines(stats: ConnectionStats) -> str:
    """The HTTP connections' gauges and counters, appended to the engine's metrics."""
    with stats._lock:
        timeouts = {f'kind="{kind}"': n for kind, n in stats.timeouts.items()}
        lines = [
            *metric("minfer_http_connections_open", "gauge", "Connections being served (each has a thread).",
                    stats.open),
            *metric("minfer_http_connections_max", "gauge", "The --max-connections cap.", stats.max_connections),
            *metric("minfer_http_connections_refused_total", "counter", "Connections refused at the cap (503).",
                    stats.refused),
            *metric("minfer_http_timeouts_total", "counter", "Connections closed by a timeout, by kind.", timeouts),
        ]
    return "\n".join(lines) + "\n"
