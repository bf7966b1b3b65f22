"""What the server counts as requests come and go: tokens, finishes, aborts, and latency histograms.

The engine worker thread calls the on_* methods; one lock guards everything, so a scrape of /metrics
(prometheus.py renders them) sees a consistent view. Gauges (running, waiting, free KV blocks) are not
kept here: they come from the scheduler stats snapshot the worker publishes after every step.
"""

from __future__ import annotations

import bisect
import threading

from ..engine.outputs import RequestOutput

# Seconds. TTFT spans queueing + prefill; TPOT is one decode step, usually much shorter.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # a whole request


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


class Metrics:
    """What /metrics reports of requests: the worker calls the on_* methods."""

    def __init__(self):
        self._lock = threading.Lock()
        self.finished = 0  # requests that ran to a finish_reason
        self.aborted = 0  # requests discarded before finishing (client gone, error, shutdown)
        self.rejected = 0  # requests refused before reaching the scheduler (e.g. 429)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def on_admitted(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def on_tokens(self, n: int) -> None:
        with self._lock:
            self.generation_tokens += n

    def on_first_token(self, seconds: float) -> None:
        """A request's first token, `seconds` after its submission: counted then, so that a request discarded
        later (its client gave up waiting, say) still counts."""
        with self._lock:
            self.ttft.observe(seconds)

    def on_finished(self, out: RequestOutput) -> None:
        with self._lock:
            self.finished += 1
            if out.finish_time is not None:
                self.e2e.observe(out.finish_time - out.arrival_time)
            if len(out.token_times) > 1:  # time per output token after the first
                span = out.token_times[-1] - out.token_times[0]
                self.tpot.observe(span / (len(out.token_times) - 1))

    def on_aborted(self, n: int = 1) -> None:
        with self._lock:
            self.aborted += n

    def on_rejected(self) -> None:
        with self._lock:
            self.rejected += 1
