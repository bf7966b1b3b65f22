"""Offline mode: drive minfer's OnlineScheduler in-process, with requests arriving over time.

LLM.generate adds every prompt up front; a benchmark with a finite request rate or
a concurrency cap needs requests to arrive *between* engine steps. So this loop
does what a server's worker thread does, minus HTTP: submit the requests whose
arrival time has come (and for which a concurrency slot is free), run one step,
collect what finished. A request's clock starts at its arrival, as a client's would: one
that arrives during a step waits for it, and its tokenization (a text prompt) counts too. Under
--max-concurrency it starts when a slot frees, at the end of the step that finished the slot's last request
(or at its arrival, if later), as vLLM's client takes a slot before it sends.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import asdict

from tqdm import tqdm

from ..engine.sampling_params import SamplingParams
from ..engine.structured_outputs_params import StructuredOutputsParams
from ..engine.scheduler import OnlineScheduler
from ..engine.outputs import RequestOutput
from .metrics import RequestRecord, RunResult
from .workload import BenchRequest


def run_offline(
    scheduler: OnlineScheduler,
    requests: list[BenchRequest],
    max_concurrency: int | None = None,
    progress: bool = True,
    desc: str = "minfer",
    n: int = 1,
    defaults: dict | None = None,
) -> RunResult:
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    live: dict[str, RequestRecord] = {}  # submitted, not yet finished
    unscheduled: dict[str, RequestRecord] = {}  # submitted, never run by a step yet (in submit order)
    done: list[RequestRecord] = []
    steps: list[dict] = []
    free_slots = [0.0] * (max_concurrency or 0)  # a heap: when each free slot became free
    t0 = time.perf_counter()

    def submit_due() -> None:
        while (
            pending
            and pending[0].arrival <= time.perf_counter() - t0
            and (max_concurrency is None or len(live) < max_concurrency)
        ):
            r = pending.popleft()
            submit = max(r.arrival, heapq.heappop(free_slots)) if max_concurrency else r.arrival
            rid = submit_request(scheduler, r, n, defaults)
            live[rid] = unscheduled[rid] = RequestRecord(
                r.index, r.input_len, n * r.output_len, submit_time=submit, num_choices=n
            )

    try:
        with tqdm(total=len(requests), desc=desc, unit="req", disable=not progress) as bar:
            while pending or live:
                submit_due()
                if not live:  # idle until the next arrival
                    time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - t0)))
                    continue
                before = scheduler.num_steps
                for _ in scheduler.steps():  # new arrivals join between steps
                    if scheduler.num_steps > before:  # a step ran (none may fit, e.g. all blocks taken)
                        before = scheduler.num_steps
                        step = asdict(scheduler.last_step)
                        step["start"] -= t0
                        step["end"] -= t0
                        steps.append(step)
                        # Admission is first come first served, so the newly scheduled are a prefix.
                        while unscheduled and scheduler.get_step_count(rid := next(iter(unscheduled))) > 0:
                            unscheduled.pop(rid).scheduled_time = step["start"]
                        for rid in scheduler.pop_finished_ids():
                            if rid in live:
                                outs = scheduler.pop_responses(rid)
                                done.append(_finish(live.pop(rid), outs, t0))
                                if max_concurrency:
                                    heapq.heappush(free_slots, done[-1].finish_time or step["end"])
                                bar.update(1)
                    submit_due()
    finally:  # an error (or Ctrl-C) must not leave requests holding KV blocks
        for rid in live:
            scheduler.discard_request(rid)
    duration = time.perf_counter() - t0
    return RunResult(sorted(done, key=lambda r: r.index), duration, steps)


def submit_request(scheduler: OnlineScheduler, r: BenchRequest, n: int = 1, defaults: dict | None = None) -> str:
    """Greedy, and ignore_eos so every request produces exactly its output length. n > 1 samples (seeded),
    or the n choices would all be the same. `defaults`: the checkpoint's sampling defaults (--generation-config),
    under the fields the workload sets, as the server fills the fields an online run's requests leave out."""
    constraint = StructuredOutputsParams(**r.structured_outputs) if r.structured_outputs else None
    common = dict(max_tokens=r.output_len, ignore_eos=True, logprobs=r.logprobs, structured_outputs=constraint)
    sampling = dict(temperature=0.0) if n == 1 else dict(temperature=1.0, seed=r.index, n=n)
    params = SamplingParams(**{**(defaults or {}), **sampling, **common})
    if r.prompt_token_ids is not None:
        return scheduler.add_request(prompt_token_ids=r.prompt_token_ids, sampling_params=params)
    return scheduler.add_request(r.prompt, sampling_params=params)


def _finish(rec: RequestRecord, outs: list[RequestOutput], t0: float) -> RequestRecord:
    """Fill in a finished request's record, its times counted from t0: the first choice's, which runs
    the prompt (its sibling choices sample in the same steps); output_len counts every choice's tokens."""
    out = outs[0]
    times = [t - t0 for t in out.token_times]  # the end of each step that sampled one of its tokens
    arrivals = list(dict.fromkeys(times))  # a speculative step's tokens arrive together, as one chunk online
    rec.output_len = sum(len(o.token_ids) for o in outs)
    rec.input_len = len(out.prompt_token_ids)
    rec.first_token_time = times[0] if times else None
    rec.finish_time = times[-1] if times else None
    rec.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    rec.num_preemptions = out.num_preemptions
    rec.num_cached_tokens = out.num_cached_tokens
    return rec
