"""Per-request timings and the summary computed from them, with vLLM's definitions.

    TTFT  time to first token: submit -> first token
    TPOT  time per output token after the first: (latency - TTFT) / (output tokens - 1),
          over requests with more than one output token
    ITL   inter-token latency: every gap between successive deliveries of a request's tokens,
          pooled over all requests: online its streamed chunks with text, offline the steps
          that sampled for it (a speculative step's tokens come together: one gap, as in vLLM)
    E2EL  end-to-end latency: submit -> last token

A request is submitted at its arrival time or, under --max-concurrency, once a slot
frees up (as in vLLM); offline too, where one that arrives during a step waits for it.
Offline, "first token" is the end of the engine step that sampled it; online, the
arrival of the first streamed chunk with text.

Each is reported as mean, median (p50), p90 and p99 in milliseconds; percentiles
interpolate linearly between order statistics (numpy's default). Throughputs
divide by the benchmark duration: first submit to last completion.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

METRICS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)
STATS = (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99"))


@dataclass
class RequestRecord:
    """One request of one run. Times are seconds since the run started (perf_counter based)."""

    index: int
    input_len: int | None
    expected_output_len: int
    output_len: int = 0  # tokens actually generated
    submit_time: float = 0.0  # when the request was handed to the engine / sent to the server
    scheduled_time: float | None = None  # offline: start of the first engine step that ran it
    first_token_time: float | None = None
    finish_time: float | None = None
    itl: list[float] = field(default_factory=list)  # seconds between successive tokens (or chunks)
    num_choices: int = 1  # n: output_len counts every choice's tokens, TPOT is per choice
    num_preemptions: int | None = None
    num_cached_tokens: int | None = None
    success: bool = True
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.submit_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.submit_time

    @property
    def tpot(self) -> float | None:
        per_choice = self.output_len / self.num_choices  # the choices run side by side
        if per_choice < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (per_choice - 1)

    def to_json(self) -> dict:
        return {**asdict(self), "ttft": self.ttft, "latency": self.latency, "tpot": self.tpot}


@dataclass
class RunResult:
    """One measured run: its requests, how long it took, and (offline) what each engine step did."""

    records: list[RequestRecord]  # in request order
    duration: float  # seconds from the run's start (just before the first submit) to the last completion
    steps: list[dict] = field(default_factory=list)  # asdict(scheduler.last_step) per step, times since the start


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly like numpy.percentile."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values_s: list[float]) -> dict[str, float | None]:
    """mean/median/p90/p99 of values in seconds, returned in milliseconds (None when empty)."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = [v * 1000 for v in values_s]
    return {
        "mean": statistics.fmean(ms),
        "median": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


def summarize(records: list[RequestRecord], duration: float, **extra) -> dict:
    """The run's summary; `extra` (peak memory, prefix-cache hits, ...) is merged in as given."""
    ok = [r for r in records if r.success]
    total_in = sum(r.input_len or 0 for r in ok)
    total_out = sum(r.output_len for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "cut_short": len(cut_short(ok)),  # completed with fewer tokens than asked: counted as they are
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    values = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok if r.latency is not None],
    }
    for metric, vs in values.items():
        for stat, v in describe(vs).items():
            summary[f"{stat}_{metric}_ms"] = v
    return {**summary, **extra}


def cut_short(records: list[RequestRecord]) -> list[RequestRecord]:
    """The requests that generated fewer tokens than asked: ended by a server that does not honour ignore_eos."""
    return [r for r in records if r.success and r.output_len < r.expected_output_len]


def cut_short_line(records: list[RequestRecord]) -> str | None:
    """One line for a run some of whose requests stopped short (None if none did): how many, the first one's."""
    short = cut_short(records)
    if not short:
        return None
    return (f"{len(short)} of {len(records)} requests generated fewer tokens than asked, the first "
            f"{short[0].output_len} of {short[0].expected_output_len}: the figures count the tokens generated")


def median_summary(summaries: list[dict]) -> dict:
    """Key by key median of several runs' summaries (None where any run has None); counts stay whole (the
    lower middle value of an even number of runs)."""
    out = {}
    for key in summaries[0]:
        vals = [s.get(key) for s in summaries]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
        median = statistics.median_low if all(isinstance(v, int) for v in vals) else statistics.median
        out[key] = median(vals) if numeric else vals[-1] if len(set(map(repr, vals))) == 1 else None
    return out


def _row(label: str, value) -> str:
    if value is None:
        return f"{label:<40} {'n/a':<10}"
    if isinstance(value, int):
        return f"{label:<40} {value:<10}"
    return f"{label:<40} {value:<10.2f}"


def format_summary(s: dict, title: str = "Serving Benchmark Result", memory_of: str | None = None) -> str:
    """The summary as vLLM's benchmark prints it; memory_of names the process whose RSS is shown."""
    lines = [f"{' ' + title + ' ':=^50}"]
    lines.append(_row("Successful requests:", s["completed"]))
    if s.get("failed"):
        lines.append(_row("Failed requests:", s["failed"]))
    if s.get("cut_short"):
        lines.append(_row("Requests cut short:", s["cut_short"]))
    lines += [
        _row("Benchmark duration (s):", s["duration"]),
        _row("Total input tokens:", s["total_input_tokens"]),
        _row("Total generated tokens:", s["total_output_tokens"]),
        _row("Request throughput (req/s):", s["request_throughput"]),
        _row("Output token throughput (tok/s):", s["output_throughput"]),
        _row("Total Token throughput (tok/s):", s["total_token_throughput"]),
    ]
    for metric, heading, short in METRICS:
        lines.append(f"{heading:-^50}")
        lines += [_row(f"{name} {short} (ms):", s[f"{stat}_{metric}_ms"]) for stat, name in STATS]
    memory = [
        (k, label)
        for k, label in (("peak_rss_mib", "Peak RSS (MiB):"), ("peak_cuda_mib", "Peak CUDA memory (MiB):"))
        if k in s
    ]
    if memory:
        heading = f"Memory ({memory_of})" if memory_of else "Memory"
        lines.append(f"{heading:-^50}")
        lines += [_row(label, s[k]) for k, label in memory]
    lines.append("=" * 50)
    return "\n".join(lines)
