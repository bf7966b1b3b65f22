"""Stage 11: the scheduler manager: one engine worker thread, many client threads.

Uses minfer.manager.SchedulerManager in-process, exactly as the HTTP server of
stage 12 does, minus HTTP: client threads submit token ids and read their
request's events (minfer/server/messages.py: Accepted, CompletionDelta per step, Done or Error). Shows that the idle
worker sleeps (its own CPU time stays ~0) and wakes at once, that only client
threads tokenize, that a request released early (a client that went away) has
its KV blocks freed, and what a refused request, a full queue and a shutdown
look like.

    python tutorials/11_scheduler_manager.py   # MINFER_MODEL=/path to choose the checkpoint
    python tutorials/11_scheduler_manager.py --exercise   # with your worker loop (tutorials/exercises/)
"""

import logging
import sys
import threading
import time
import traceback

from _common import exercise, model_path, section
from _timing import Timing

from minfer import OnlineScheduler, SamplingParams
from minfer.errors import InvalidParameter
from minfer.models.gpt2 import GPT2
from minfer.server.manager import EngineError, SchedulerManager
from minfer.server.messages import Accepted, CompletionDelta, Done, Error
from minfer.server.metrics import Metrics
from minfer.text.tokenizer import Tokenizer

graded = exercise("11")  # --exercise: your worker loop (tutorials/exercises/) run instead of minfer's
path = model_path()
model = GPT2.from_pretrained(path)
tokenizer = Tokenizer.from_dir(path)
prompts = ["The weather today is", "My favourite food is", "In the year 2050,", "The secret of cooking rice is"]
# 48 tokens: long enough that four clients, started together, overlap even on a busy machine.
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
# Long enough to still be running when a client leaves; half the context leaves room for the prompt.
LONG = SamplingParams(max_tokens=min(200, model.config.n_positions // 2), temperature=0, ignore_eos=True)


def wait_for(condition, what: str, timeout: float = 60.0) -> float:
    """Poll until condition() is true; return the seconds it took (generous timeout: shared machine)."""
    start = time.perf_counter()
    while not condition():
        assert time.perf_counter() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.005)
    return time.perf_counter() - start


# References first, on a scheduler of our own: once the manager starts, its scheduler is the worker's.
reference = OnlineScheduler(model, tokenizer, num_kv_blocks=64)
ref_ids = [reference.add_request(p, sampling_params=GREEDY) for p in prompts]
while reference.has_unfinished():
    reference.step()
expected = {p: reference.pop_response(r) for p, r in zip(prompts, ref_ids)}

# Count who tokenizes: the handler side should, once per request; the worker never.
encoders: list[str] = []
plain_encode = tokenizer.encode
tokenizer.encode = lambda text: encoders.append(threading.current_thread().name) or plain_encode(text)

sched = OnlineScheduler(model, tokenizer, num_kv_blocks=64, max_num_seqs=8)
manager = SchedulerManager(sched, Metrics(), max_queued=4)
manager.start()
worker = next(t for t in threading.enumerate() if t.name == "minfer-engine")  # the thread start() began

section("an idle worker sleeps on an Event: no polling, no CPU")
clock = time.pthread_getcpuclockid(worker.ident)  # that one thread's CPU-time clock (Linux, macOS)
cpu0, wall0 = time.clock_gettime(clock), time.perf_counter()
time.sleep(0.5)
idle_cpu, wall = time.clock_gettime(clock) - cpu0, time.perf_counter() - wall0
print(f"worker CPU time over {wall:.2f} s idle: {1e3 * idle_cpu:.2f} ms")
assert idle_cpu < 0.1 * wall, "an idle worker must not spin"  # a polling loop would burn ~100%
idle_stack = traceback.extract_stack(sys._current_frames()[worker.ident])  # where the worker is, right now
assert any(f.name == "wait" and f.filename == threading.__file__ for f in idle_stack), (
    "an idle worker must sleep in its Event's wait(), woken by submit(): it is in\n" + "".join(idle_stack.format())
)
caller = next(f.name for f in reversed(idle_stack) if f.filename != threading.__file__)
print(f"the idle worker is inside threading's wait(), called from {caller}()")
first_ids = tokenizer.encode(prompts[0])  # in this (client) thread, once
wake_ups = []  # submit -> Accepted, each time from an idle worker
for _ in range(5):
    t0 = time.perf_counter()
    handle = manager.submit(manager.check(first_ids, SamplingParams(max_tokens=1)))
    assert handle.next_event(timeout=30) == Accepted()  # submit appended to the inbox, then wake.set()
    wake_ups.append(time.perf_counter() - t0)
    while not isinstance(handle.next_event(timeout=30), Done):
        pass
    manager.release(handle)
    wait_for(lambda: manager.stats()["num_running"] == 0, "the worker to be idle again")
print(f"submit -> Accepted, from an idle worker: {Timing(wake_ups)} (the worker wakes at once; not asserted)")
handle = manager.submit(manager.check(first_ids, GREEDY))
event = handle.next_event(timeout=30)
assert event == Accepted()
while not isinstance(event, Done):
    event = handle.next_event(timeout=30)
manager.release(handle)

section(f"{len(prompts)} client threads, each streaming its own request")
results: dict[str, dict] = {}
burst = threading.Barrier(len(prompts))  # all clients submit at the same moment


def client(prompt: str) -> None:
    """What an HTTP handler thread does: tokenize, submit, read events until DONE, release."""
    ids = tokenizer.encode(prompt)  # here, in the client's thread, never on the worker
    burst.wait()
    h = manager.submit(manager.check(ids, GREEDY))
    events = []
    try:
        while not events or not isinstance(events[-1], (Done, Error)):
            events.append(h.next_event(timeout=60))
    finally:
        manager.release(h)  # always: a handler that stops early must give the request back
    results[prompt] = {"events": events}


threads = [threading.Thread(target=client, args=(p,), name=f"client-{i}") for i, p in enumerate(prompts)]
for t in threads:
    t.start()
for t in threads:
    t.join()
for p in prompts:
    events = results[p]["events"]
    kinds = [type(e) for e in events]
    assert kinds[0] is Accepted and kinds[-1] is Done and set(kinds[1:-1]) <= {CompletionDelta}, kinds
    out, deltas = events[-1].outputs[0], events[1:-1]
    streamed = "".join(d.text for d in deltas)
    print(f"{p!r:34} {len(deltas):2} deltas -> {streamed!r}")
    # One delta per step that sampled a token for it: 48 steps, one token each (the prompt in one chunk).
    assert [d.token_ids for d in deltas] == [[t] for t in out.token_ids], "each step's new token, in order"
    assert streamed == out.text, "the streamed text adds up to the final text"
    assert deltas[-1].finish_reason == out.finish_reason and {d.index for d in deltas} == {0}
    assert out.token_ids == expected[p].token_ids, "the same tokens as the request run alone"
# They ran together: the requests that came before the engine's first token (submitted at once) had
# their first tokens before it finished any of them: continuous batching admits each at the next step.
# The engine's own timestamps, not the clients': a client thread may read its events late, and on a
# busy machine one may even submit late, after the others ran.
outs = [results[p]["events"][-1].outputs[0] for p in prompts]
together = [o for o in outs if o.arrival_time < min(p.first_token_time for p in outs)]
assert max(o.first_token_time for o in together) < min(o.finish_time for o in together)
print(f"submitted together: {len(together)} of {len(outs)}, each admitted before any of them finished")
print(f"tokenized by: {sorted(set(encoders))}")
assert len(encoders) == 1 + len(prompts) and "minfer-engine" not in encoders

section("a client that goes away: release() before Done, and the worker frees its blocks")
total = sched.allocator.num_blocks
handle = manager.submit(manager.check(tokenizer.encode("Tell me a very long story about"), LONG))
assert handle.next_event(timeout=30) == Accepted()
for _ in range(3):
    event = handle.next_event(timeout=30)
    assert isinstance(event, CompletionDelta)
stats = manager.stats()  # a snapshot the worker publishes after every step; handlers never touch sched
print(
    f"streaming; stats snapshot: running {stats['num_running']}, "
    f"{stats['num_kv_blocks_total'] - stats['num_kv_blocks_free']} blocks in use"
)
assert stats["num_running"] == 1 and stats["num_kv_blocks_free"] < total
manager.release(handle)  # not finished: queues a discard for the worker
wait_for(
    lambda: manager.stats()["num_kv_blocks_free"] == total and manager.stats()["num_running"] == 0,
    "the blocks to come back",
)
print(f"released; {total}/{total} blocks free again; aborted requests: {manager.metrics.aborted}")
assert manager.metrics.aborted == 1

section("a request that could never run is refused by check(), in the client's thread, before submit()")
try:  # the scheduler's own check (check_request), run before the request reaches the worker
    manager.check(tokenizer.encode("Hi"), SamplingParams(max_tokens=model.config.n_positions))
    raise AssertionError("the manager must refuse a request longer than the context")
except InvalidParameter as e:
    print(f"InvalidParameter(param={e.param!r}, code={e.code!r}): {e}")
    assert e.param == "max_tokens" and e.code == "context_length_exceeded"

section(f"a full queue: at most max_num_seqs + max_queued = {manager.max_in_flight} requests in flight")
handles = [manager.submit(manager.check(tokenizer.encode(f"Request number {i}"), LONG))
           for i in range(manager.max_in_flight)]
try:
    manager.submit(manager.check(tokenizer.encode("one too many"), GREEDY))
    raise AssertionError("the manager must refuse beyond max_in_flight")
except EngineError as e:
    print(f"request {manager.max_in_flight + 1} -> EngineError {e.status}: {e.message}")
    assert e.status == 429
for h in handles:
    manager.release(h)  # all unfinished: every one is discarded
wait_for(lambda: manager.stats()["num_kv_blocks_free"] == total and manager.stats()["num_waiting"] == 0, "the discards")
print(f"all released: {manager.stats()['num_kv_blocks_free']}/{total} blocks free")

section("idle again, then shut down: requests in flight get a 503 Error")
cpu0, wall0 = time.clock_gettime(clock), time.perf_counter()
time.sleep(0.3)
idle_cpu, wall = time.clock_gettime(clock) - cpu0, time.perf_counter() - wall0
print(f"worker CPU time over {wall:.2f} s idle: {1e3 * idle_cpu:.2f} ms")
assert idle_cpu < 0.1 * wall
handle = manager.submit(manager.check(tokenizer.encode("Unfinished business"), LONG))
assert handle.next_event(timeout=30) == Accepted()
manager.shutdown()
event = handle.next_event(timeout=30)
while isinstance(event, CompletionDelta):  # steps run before the shutdown, then the error
    event = handle.next_event(timeout=30)
manager.release(handle)
print(f"in flight at shutdown: {event}")
assert isinstance(event, Error) and event.status == 503 and not manager.is_alive()
assert event.message == "the server is shutting down", "a shutdown is not a crash: the message says which"
try:
    manager.submit(manager.check(tokenizer.encode("too late"), GREEDY))
    raise AssertionError("a stopped manager must refuse")
except EngineError as e:
    print(f"submit after shutdown -> EngineError {e.status}: {e.message}")
    assert e.status == 503 and e.message == "the server is shutting down"
# The worker has exited, so touching the scheduler from this thread is safe again.
assert sched.allocator.num_free_blocks == total and not sched.has_unfinished()
sched.check_invariants()

section("a crash: the worker's loop dies, and still every request gets an answer")
doomed = OnlineScheduler(model, tokenizer, num_kv_blocks=64)
plain_has_unfinished = doomed.has_unfinished


def has_unfinished() -> bool:
    """A bug planted in the loop itself: it raises as soon as there is work (a failed step is not enough:
    the manager fails that step's requests and goes on serving)."""
    if plain_has_unfinished():
        raise RuntimeError("a bug in the engine, planted by this stage")
    return False


doomed.has_unfinished = has_unfinished
crashing = SchedulerManager(doomed, Metrics())
crashing.start()
logging.getLogger("minfer.serve").disabled = True  # the planted error's logged traceback would only confuse
handle = crashing.submit(crashing.check(first_ids, GREEDY))
events = [handle.next_event(timeout=3) for _ in range(2)]  # a crash answers in milliseconds
crashing.release(handle)
logging.getLogger("minfer.serve").disabled = False
print(f"in flight when the loop died: {events}")
assert events[0] == Accepted() and isinstance(events[1], Error) and events[1].status == 503, (
    f"a request in flight when the worker's loop dies gets a 503 Error, not silence: {events[1]!r} (wind down "
    "in a finally)")
assert events[1].message == "the engine has stopped", f"a crash is not a shutdown: {events[1].message!r}"
assert not crashing.is_alive()
try:
    crashing.submit(crashing.check(first_ids, GREEDY))
    raise AssertionError("a dead manager must refuse")
except EngineError as e:
    print(f"submit after the crash -> EngineError {e.status}: {e.message}")
    assert e.status == 503 and e.message == "the engine has stopped"
graded.graded()
print("\nOK: one worker thread, event wake-up, per-request event queues, early release frees blocks, clean shutdown.")
