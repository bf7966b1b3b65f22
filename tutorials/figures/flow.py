"""Figures of the engine in motion, each drawn from a real run on minfer-tiny (stages 10, 11, 12).

- step_timeline: an OnlineScheduler stepped by hand; each step's chunks (`last_chunks`) and statistics.
- thread_flow: a SchedulerManager with two client threads; what each thread did, in the order it did it.
- http_path: a server in-process, one streamed completion, and a profiler on every thread recording
  which of minfer's functions ran, in order, on which thread.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time

from svg import CACHED, FAINT, INK, SEQUENCE_COLOURS, Svg

from minfer import OnlineScheduler, SamplingParams
from minfer.engine.sequence import Status
from minfer.models.gpt2 import GPT2
from minfer.models.loader import resolve_model_dir
from minfer.server.manager import SchedulerManager
from minfer.server.messages import Accepted, CompletionDelta, Done
from minfer.text.tokenizer import Tokenizer

PREFILL, DECODE, PREEMPTED = "#f4a259", "#8cb369", "#bc4b51"


def tiny():
    path = resolve_model_dir("minfer-tiny")
    return GPT2.from_pretrained(path), Tokenizer.from_dir(path)


# ---------------------------------------------------------------------------------------------------
def step_timeline(out) -> None:
    """Stage 10: continuous batching with chunked prefill and a preemption, one column per step."""
    model, tokenizer = tiny()
    words = tokenizer.encode("Continuous batching lets a request join the running batch at any step. ")

    def prompt(n: int, offset: int) -> list[int]:
        return (words * (n // len(words) + offset + 2))[offset : offset + n]

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    budget, num_blocks = 32, 8
    sched = OnlineScheduler(model, tokenizer, block_size=16, num_kv_blocks=num_blocks, max_num_seqs=3,
                            max_num_batched_tokens=budget)
    arrivals = {1: [("A", prompt(10, 0), greedy(24)), ("B", prompt(20, 1), greedy(30))],
                2: [("C", prompt(60, 2), greedy(6))], 4: [("D", prompt(8, 3), greedy(5))]}
    names = [name for step in sorted(arrivals) for name, _, _ in arrivals[step]]
    seqs, cells, totals = {}, [], []  # cells[step]: name -> (kind, tokens)
    step = 0
    while step == 0 or sched.has_unfinished():
        step += 1
        for name, ids, params in arrivals.get(step, []):
            seqs[name] = sched.requests[sched.add_request(prompt_token_ids=ids, sampling_params=params)].seq
        preempted_before = {name: seq.num_preemptions for name, seq in seqs.items()}
        sched.step()
        ran = {chunk.seq: chunk for chunk in sched.last_chunks}
        row = {}
        for name, seq in seqs.items():
            if seq.num_preemptions > preempted_before[name]:
                row[name] = ("preempted", 0)
            elif seq in ran:
                chunk = ran[seq]
                decode = chunk.num_tokens == 1 and chunk.start >= seq.num_prompt_tokens
                row[name] = ("decode" if decode else "prefill", chunk.num_tokens)
            elif seq.status is Status.WAITING:
                row[name] = ("waiting", 0)
        cells.append(row)
        s = sched.last_step
        totals.append((s.num_prefill_tokens, s.num_decode_tokens, s.kv_blocks_used))
        sched.pop_finished_ids()
    assert sched.num_preemptions > 0 and any(k == "prefill" and n < 60 for r in cells for k, n in r.values())

    col, x0, y0, row_h = 21, 70, 64, 24
    width = max(x0 + col * len(cells) + 20, 860)
    svg = Svg(width, 400, "A step timeline (stage 10)")
    svg.text(20, 24, f"OnlineScheduler on minfer-tiny: max_num_seqs=3, a budget of {budget} tokens a step, "
             f"{num_blocks} KV blocks of 16", size=13, bold=True)
    svg.text(20, 42, f"A and B arrive at step 1, C (a 60-token prompt) at step 2, D at step 4; each column is one "
             f"step, one forward pass; {sched.num_preemptions} preemption", size=11)
    fills = {"prefill": PREFILL, "decode": DECODE, "waiting": CACHED, "preempted": PREEMPTED}
    for i in range(len(cells)):
        if i % 5 == 0 or i == len(cells) - 1:
            svg.text(x0 + i * col + col / 2, y0 - 6, i + 1, size=9, anchor="middle", fill=FAINT)
    for r, name in enumerate(names):
        y = y0 + r * row_h
        svg.text(20, y + 16, name, size=12, bold=True)
        for i, row in enumerate(cells):
            if name not in row:
                continue
            kind, tokens = row[name]
            svg.rect(x0 + i * col, y, col - 2, row_h - 4, fill=fills[kind], rx=1, stroke="#555555", width=0.5)
            label = tokens if kind == "prefill" else "✕" if kind == "preempted" else ""
            svg.text(x0 + i * col + (col - 2) / 2, y + 14, label, size=9, anchor="middle",
                     fill="#ffffff" if kind == "preempted" else INK)
    # Tokens per step against the budget, and blocks in use.
    base, scale = y0 + len(names) * row_h + 100, 70 / budget
    svg.text(20, base - 70 - 14, "tokens per step", size=11, bold=True)
    svg.line(x0, base - budget * scale, x0 + col * len(cells), base - budget * scale, stroke=FAINT, dash="4 3")
    svg.text(x0 - 4, base - budget * scale + 4, budget, size=9, anchor="end", fill=FAINT)
    for i, (prefill, decode, blocks) in enumerate(totals):
        x = x0 + i * col
        svg.rect(x, base - decode * scale, col - 2, decode * scale, fill=DECODE, rx=0, width=0.4)
        svg.rect(x, base - (decode + prefill) * scale, col - 2, prefill * scale, fill=PREFILL, rx=0, width=0.4)
        svg.text(x + (col - 2) / 2, base + 14, blocks, size=9, anchor="middle", fill=FAINT)
    svg.text(x0 - 4, base + 14, "blocks", size=9, anchor="end", fill=FAINT)
    svg.legend(20, base + 44, [(PREFILL, "prefill chunk (its tokens)"), (DECODE, "decode (1 token)"),
                               (CACHED, "waiting"), (PREEMPTED, "preempted: blocks freed, recomputed later")])
    svg.height = base + 60
    svg.save(out)


# ---------------------------------------------------------------------------------------------------
def thread_flow(out) -> None:
    """Stage 11: two client threads and the worker, what each did and when, from one real run."""
    model, tokenizer = tiny()
    sched = OnlineScheduler(model, tokenizer, num_kv_blocks=16, max_num_seqs=4)
    log: list[tuple[float, str, str, str | None]] = []  # (time, thread, what, arrow to that thread)
    start = time.perf_counter()

    def note(what: str, to: str | None = None, thread: str | None = None) -> None:
        log.append((time.perf_counter() - start, thread or threading.current_thread().name, what, to))

    add_request, step, has_unfinished = sched.add_request, sched.step, sched.has_unfinished
    sleeping = [False]

    def recorded_add(checked, **fields):
        note(f"add_request({fields.get('request_id')})")
        return add_request(checked, **fields)

    def recorded_step():
        sampled = step()
        s = sched.last_step
        note(f"step: {s.num_prefill_tokens} prefill + {s.num_decode_tokens} decode tokens")
        return sampled

    def recorded_has_unfinished():
        busy = has_unfinished()
        if threading.current_thread().name == "minfer-engine" and not busy and not sleeping[0]:
            note("idle: sleeps in wake.wait()")
        sleeping[0] = not busy
        return busy

    sched.add_request, sched.step, sched.has_unfinished = recorded_add, recorded_step, recorded_has_unfinished
    manager = SchedulerManager(sched)
    manager.start()
    second_may_go = threading.Event()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    failures = []  # what went wrong on a client thread: the figure is not drawn from a run that failed

    def client(index: int, prompt: str) -> None:
        try:
            read_one_request(index, prompt)
        except Exception as e:
            failures.append(f"{threading.current_thread().name}: {e!r}")
            second_may_go.set()

    def read_one_request(index: int, prompt: str) -> None:
        if index:
            second_may_go.wait(30)  # the second arrives while the first runs: it joins the batch
        handle = manager.submit(manager.check(tokenizer.encode(prompt), params))
        note(f"submit(): request {handle.request_id} to the inbox, wake.set()", to="minfer-engine")
        while True:
            event = handle.next_event(timeout=30)
            if not isinstance(event, (Accepted, CompletionDelta, Done)):
                raise RuntimeError(f"the worker answered {event!r}")
            worker_said = type(event).__name__
            note(f"reads {worker_said}", thread=threading.current_thread().name)
            if isinstance(event, CompletionDelta) and not index:
                second_may_go.set()
            if isinstance(event, Done):
                break
        manager.release(handle)
        note("release()")

    threads = [threading.Thread(target=client, args=(i, p), name=f"client-{i}")
               for i, p in enumerate(["Once upon a time", "The little dog"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.05)  # let the worker reach its wait() and say so
    manager.shutdown()
    if failures:
        raise SystemExit(f"figure 11: a client's request failed: {'; '.join(failures)}")
    lanes = ["client-0", "client-1", "minfer-engine"]
    log = [entry for entry in sorted(log) if entry[1] in lanes]

    lane_x = {lane: 130 + i * 250 for i, lane in enumerate(lanes)}
    row_h, y0 = 19, 78
    svg = Svg(900, y0 + row_h * len(log) + 40, "Threads and queues (stage 11)")
    svg.text(20, 24, "SchedulerManager, two client threads, one real run on minfer-tiny (3 tokens each), in the "
             "order it happened", size=13, bold=True)
    titles = {"client-0": "client-0 (a handler)", "client-1": "client-1 (a handler)",
              "minfer-engine": "minfer-engine (the worker)"}
    for lane, x in lane_x.items():
        svg.text(x, 52, titles[lane], size=12, bold=True, anchor="middle")
        svg.line(x, 58, x, y0 + row_h * len(log), stroke="#cccccc", width=1)
    source_row = {}  # what the worker did last that puts an event in a queue: its row
    for i, (t, thread, what, to) in enumerate(log):
        y = y0 + i * row_h
        svg.text(20, y + 4, f"{1e3 * t:6.1f} ms", size=9, mono=True, fill=FAINT)
        x = lane_x[thread]
        colour = SEQUENCE_COLOURS[lanes.index(thread)]
        svg.rect(x - 5, y - 5, 10, 10, fill=colour, rx=5, width=0.6)
        right = thread != "minfer-engine"
        svg.text(x + 10 if right else x - 10, y + 4, what, size=10, anchor="start" if right else "end")
        if to is not None:  # a message into the worker's inbox
            svg.line(x + 6, y + 6, lane_x[to] - 6, y + 6, stroke=colour, width=0.8, dash="3 2", arrow=True)
        if what.startswith(("step", "add_request")):
            source_row["Accepted" if what.startswith("add_request") else "step"] = y
        if what.startswith("reads"):  # Accepted comes from add_request, every other event from a step
            y_from = source_row.get("Accepted" if what.endswith("Accepted") else "step")
            if y_from is not None:
                svg.curve(lane_x["minfer-engine"] - 6, y_from + 2, x + 6, y - 2, bend=0, stroke="#999999",
                          width=0.7, arrow=True)
    svg.text(20, y0 + row_h * len(log) + 20, "dashed: a message through the inbox, then wake.set(); grey: an event "
             "through the request's own queue, read by next_event()", size=10, fill=FAINT, italic=True)
    svg.save(out)


# ---------------------------------------------------------------------------------------------------
# Functions a streamed completion must run, on the handler's thread and then on the worker's, in the
# order of life_of_a_request.md. A rename makes the drawing fail, naming the one that no longer ran.
LANDMARKS = {
    "handler": [
        "RoutingHandler.route_request", "APIHandler.handle_completions", "parse_completion", "SchedulerManager.check",
        "OnlineScheduler.check_request", "SchedulerManager.submit", "RequestHandle.next_event",
        "RoutingHandler.begin_stream", "Responder.delta_chunks", "RoutingHandler.send_event",
        "SchedulerManager.release",
    ],
    "worker": [
        "OnlineScheduler.add_request", "OnlineScheduler.step", "ContinuousBatcher.schedule", "ModelRunner.execute",
        "GPT2.forward", "paged_attention", "ModelRunner.sample", "OnlineScheduler.get_new_outputs",
        "OnlineScheduler.pop_responses",
    ],
}


def http_path(out) -> None:
    """Stage 12: one streamed /v1/completions, the functions it ran on each thread, in the order they first ran."""
    from minfer.server.serve import create_server

    seen: list[tuple[str, str]] = []  # (thread name, qualname): each function's first call on each thread
    first = set()
    recording = [False]

    def profile(frame, event, arg):
        if recording[0] and event == "call" and "/minfer/" in frame.f_code.co_filename:
            key = (threading.current_thread().name, frame.f_code.co_qualname)
            if key not in first:
                first.add(key)
                seen.append(key)

    threading.setprofile(profile)
    sys.setprofile(profile)
    server = create_server("minfer-tiny", port=0, log_requests=False, dtype="float32", attention_backend="eager")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    body = {"model": "minfer-tiny", "prompt": "Once upon a time", "max_tokens": 4, "stream": True}

    def post() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read()
        conn.close()

    try:
        post()  # a warm-up: first calls of anything are not the request's path
        server.manager.wait_released(10)  # its handler has let go of the request (after its last bytes)
        recording[0] = True
        post()
        server.manager.wait_released(10)
        recording[0] = False
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
        server.stop(grace=1.0)
    # The request's own handler thread is the one that routed it (the warm-up's may still be finishing).
    threads = {"handler": next((t for t, n in seen if n == "RoutingHandler.route_request"), None),
               "worker": next((t for t, n in seen if n == "OnlineScheduler.step"), None)}
    lanes = {}
    for lane, names in LANDMARKS.items():
        order = {n: i for i, (t, n) in enumerate(seen) if t == threads[lane]}
        missing = [n for n in names if n not in order]
        if missing:
            raise SystemExit(f"figure 12: {', '.join(missing)} did not run on the {lane} thread during a streamed "
                             "completion: minfer moved it; update LANDMARKS in tutorials/figures/flow.py")
        lanes[lane] = sorted(names, key=order.get)
    worker_thread = threads["worker"]

    svg = Svg(900, 480, "The HTTP request path (stage 12)")
    svg.text(20, 24, "One streamed POST /v1/completions on minfer-tiny: functions it ran, in the order they first ran",
             size=13, bold=True)
    svg.text(20, 42, f"(profiled on every thread; the worker thread is {worker_thread!r})", size=11, fill=FAINT)
    columns = {"handler": (40, "the connection's handler thread", SEQUENCE_COLOURS[0]),
               "worker": (480, "the engine's worker thread", SEQUENCE_COLOURS[1])}
    boxes = {}
    for lane, names in lanes.items():
        x, title, colour = columns[lane]
        svg.text(x, 72, title, size=12, bold=True)
        for i, name in enumerate(names):
            y = 84 + i * 34
            svg.rect(x, y, 330, 24, fill=colour)
            svg.text(x + 10, y + 16, name, size=11, mono=True)
            if i:
                svg.line(x + 165, y - 10, x + 165, y - 1, stroke=INK, width=1, arrow=True)
            boxes[name] = (x, y)
    submit, add = boxes["SchedulerManager.submit"], boxes["OnlineScheduler.add_request"]
    svg.line(submit[0] + 330, submit[1] + 12, add[0], add[1] + 12, stroke=INK, width=1, dash="4 3", arrow=True)
    svg.text(405, add[1] + 2 + (submit[1] - add[1]) / 2, "inbox", size=10, anchor="middle", italic=True)
    deltas, reads = boxes["OnlineScheduler.get_new_outputs"], boxes["Responder.delta_chunks"]
    svg.line(deltas[0], deltas[1] + 12, reads[0] + 330, reads[1] + 12, stroke=INK, width=1, dash="4 3", arrow=True)
    svg.text(405, reads[1] + 28 + (deltas[1] - reads[1]) / 2, "events", size=10, anchor="middle", italic=True)
    svg.text(20, 470, "dashed: what crosses between the threads (the inbox, then each request's event queue); "
             "docs/life_of_a_request.md walks the same path", size=10, fill=FAINT, italic=True)
    svg.save(out)
