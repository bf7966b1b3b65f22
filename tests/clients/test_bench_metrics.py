"""bench.py's figures from known timestamps: each metric of `summarize` against its definition (vLLM's), the
failed requests out of every figure, and the offline loop's own clock (when a request's time starts, what its
ITL gaps are) on a real engine whose steps are slowed down."""

import time

import numpy as np
import pytest

from minfer.assembly.llm import LLM
from minfer.bench.metrics import RequestRecord, summarize
from minfer.bench.offline import _finish, run_offline
from minfer.bench.workload import BenchRequest
from minfer.engine.outputs import RequestOutput


def record(index, submit, token_times, *, input_len=10, success=True, n=1):
    """A request whose (first choice's) tokens came at token_times; output_len counts n choices."""
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return RequestRecord(index, input_len, n * len(token_times), output_len=n * len(token_times),
                         submit_time=submit, first_token_time=token_times[0] if token_times else None,
                         finish_time=token_times[-1] if token_times else submit + 1.0, itl=gaps, num_choices=n,
                         success=success, error=None if success else "OSError: HTTP 429")


def test_each_figure_is_its_definition():
    records = [
        record(0, 0.0, [0.5, 0.6, 0.7, 0.8]),  # TTFT 0.5, TPOT 0.1, E2EL 0.8
        record(1, 0.2, [1.0, 1.3]),  # TTFT 0.8, TPOT 0.3, E2EL 1.1
        record(2, 0.4, [0.9]),  # one token: a TTFT and an E2EL, but no TPOT and no ITL gap
        record(3, 0.1, [0.3, 0.4, 0.5], n=2),  # two choices side by side: 6 tokens, TPOT per choice 0.1
        record(4, 0.0, [0.2, 0.3, 3.0], input_len=99, success=False),  # failed: out of every figure
    ]
    s = summarize(records, duration=2.0)
    ok = records[:4]
    assert s["completed"] == 4 and s["failed"] == 1
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 4 + 2 + 1 + 6
    assert s["request_throughput"] == 4 / 2.0 and s["output_throughput"] == 13 / 2.0
    assert s["total_token_throughput"] == (40 + 13) / 2.0
    expected = {
        "ttft": [0.5, 0.8, 0.5, 0.2],
        "tpot": [0.1, 0.3, 0.1],  # per request, then summarized: the 1-token request has none
        "itl": [0.1, 0.1, 0.1, 0.3, 0.1, 0.1],  # every gap of every request, pooled
        "e2el": [0.8, 1.1, 0.5, 0.4],
    }
    assert ok[2].tpot is None and [ok[0].tpot, ok[1].tpot, ok[3].tpot] == pytest.approx([0.1, 0.3, 0.1])
    for metric, values in expected.items():
        ms = np.array(values) * 1000
        assert s[f"mean_{metric}_ms"] == pytest.approx(ms.mean())
        for stat, q in (("median", 50), ("p90", 90), ("p99", 99)):
            assert s[f"{stat}_{metric}_ms"] == pytest.approx(np.percentile(ms, q)), (stat, metric)


def test_a_run_with_only_one_token_requests_has_no_tpot_or_itl():
    s = summarize([record(0, 0.0, [0.25]), record(1, 0.0, [0.5])], duration=1.0)
    assert s["mean_ttft_ms"] == pytest.approx(375.0)
    assert all(s[f"{stat}_{m}_ms"] is None for stat in ("mean", "median", "p90", "p99") for m in ("tpot", "itl"))


def test_offline_itl_is_one_gap_per_step_that_brought_tokens():
    """A speculative step emits several tokens at once: a client gets them in one chunk, one gap (vLLM's ITL, and
    bench's online one); gaps of 0 between tokens of one step would halve the median ITL and say nothing."""
    t0 = 100.0
    steps = [100.5, 100.6, 100.6, 100.6, 100.7, 100.9, 100.9]  # the end of the step that sampled each token
    out = RequestOutput("r", [1, 2, 3], list(range(7)), "", "length", token_times=steps)
    rec = _finish(RequestRecord(0, 3, 7, submit_time=0.0), [out], t0)
    assert rec.output_len == 7 and rec.first_token_time == pytest.approx(0.5)
    assert rec.itl == pytest.approx([0.1, 0.1, 0.2])
    assert rec.tpot == pytest.approx(0.4 / 6)  # TPOT still counts every token


@pytest.fixture
def slow_scheduler(tiny_checkpoint):
    """The tiny engine with every step lasting at least STEP seconds, so arrivals fall inside steps."""
    scheduler = LLM(str(tiny_checkpoint)).scheduler
    step = scheduler.step

    def slow_step():
        start = time.perf_counter()
        out = step()
        time.sleep(max(0.0, STEP - (time.perf_counter() - start)))
        return out

    scheduler.step = slow_step
    return scheduler


STEP = 0.05


def bench_request(index, arrival, output_len=3):
    return BenchRequest(index, None, [5 + index, 6, 7, 8], 4, output_len, arrival)


def test_offline_clock_starts_at_arrival_even_while_a_step_runs(slow_scheduler):
    """A request arriving during a step waits for it, as it would in a server: that wait is in its TTFT."""
    requests = [bench_request(0, 0.0), bench_request(1, STEP / 5)]  # the second arrives during the first step
    result = run_offline(slow_scheduler, requests, progress=False)
    assert [r.submit_time for r in result.records] == [0.0, STEP / 5]


def test_offline_clock_starts_when_a_slot_frees_under_max_concurrency(slow_scheduler):
    """--max-concurrency: a request's clock starts when it gets a slot (vLLM's), the end of the step in which
    the request holding the slot finished, or its arrival if that is later."""
    requests = [bench_request(0, 0.0), bench_request(1, 0.0), bench_request(2, 10 * STEP, 1)]
    first, second, third = run_offline(slow_scheduler, requests, max_concurrency=1, progress=False).records
    assert first.submit_time == 0.0
    assert second.submit_time == first.finish_time
    assert third.submit_time == max(10 * STEP, second.finish_time)
