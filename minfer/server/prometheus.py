"""Prometheus: the server's counters and histograms, rendered in the Prometheus text format for /metrics.

The engine worker thread updates them; HTTP handler threads render them for
`GET /metrics`. One lock guards everything, so a scrape sees a consistent view.
Gauges (running, waiting, free KV blocks) are not stored here: they come from
the scheduler stats snapshot the worker publishes after every step.
"""

from __future__ import annotations

import bisect
import os
import threading

from ..engine.sequence import RequestOutput

# Seconds. TTFT spans queueing + prefill; TPOT is one decode step, usually much shorter.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


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
        "Prompt tokens served from the prefix cache.",
        "prefix_cache_hit_tokens",
    ),
]
# Speculative decoding's counters (vLLM's spec_decode_* names), when the engine speculates.
SPEC_DECODE = [
    ("spec_decode_num_drafts_total", "Verifications: steps in which a sequence checked proposals.", "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens_total", "Proposed tokens verified.", "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens_total", "Proposed tokens accepted.", "spec_decode_num_accepted_tokens"),
]


class Histogram:
    """Counts of observations per bucket, plus their sum and count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)  # not cumulative; render() accumulates
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # first bucket whose bound is >= value
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, total = [], 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {total}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.sum}")
        lines.append(f"{name}_count {self.count}")
        return lines


class Metrics:
    """What /metrics reports. The worker calls the on_* methods; handlers call render()."""

    def __init__(self):
        self._lock = threading.Lock()
        self.finished = 0  # requests that ran to a finish_reason
        self.aborted = 0  # requests discarded before finishing (client gone, error, shutdown)
        self.rejected = 0  # requests refused before reaching the scheduler (e.g. 429)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def on_admitted(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def on_tokens(self, n: int) -> None:
        with self._lock:
            self.generation_tokens += n

    def on_finished(self, out: RequestOutput) -> None:
        with self._lock:
            self.finished += 1
            if out.first_token_time is not None:
                self.ttft.observe(out.first_token_time - out.arrival_time)
            if len(out.token_times) > 1:  # time per output token after the first
                span = out.token_times[-1] - out.token_times[0]
                self.tpot.observe(span / (len(out.token_times) - 1))

    def on_aborted(self, n: int = 1) -> None:
        with self._lock:
            self.aborted += n

    def on_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def render(self, stats: dict) -> str:
        """Prometheus text exposition; `stats` is the latest scheduler.stats() snapshot."""
        with self._lock:
            lines = []
            for name, kind, help_text, key in FROM_STATS:
                lines += metric("minfer_" + name, kind, help_text, stats.get(key, 0))
            if "spec_decode_num_drafts" in stats:
                lines += spec_decode_metrics(stats)
            if "num_path_fallbacks" in stats:  # compiled/forward.py: where a compiled path can fail
                help_text = "Compiled paths (attention, CUDA graphs, compiled steps) switched off for eager ones."
                lines += metric("minfer_path_fallbacks_total", "counter", help_text, stats["num_path_fallbacks"])
            for name, help_text, value in [
                ("requests_finished_total", "Requests that finished (stop or length).", self.finished),
                ("requests_aborted_total", "Requests discarded before finishing.", self.aborted),
                ("requests_rejected_total", "Requests refused because the queue was full.", self.rejected),
                ("prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens),
                ("generation_tokens_total", "Tokens generated.", self.generation_tokens),
            ]:
                lines += metric("minfer_" + name, "counter", help_text, value)
            for name, help_text, hist in [
                ("time_to_first_token_seconds", "Time from arrival to the first generated token.", self.ttft),
                ("time_per_output_token_seconds", "Mean time between output tokens, per request.", self.tpot),
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
        return lines + value.render(name)
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
