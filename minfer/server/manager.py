"""SchedulerManager: the one engine worker thread between HTTP handlers and the OnlineScheduler.

The scheduler is not thread-safe, so exactly one thread, the worker, ever calls it. Handler threads
talk to it through two things only (messages.py): the inbox of AddRequest and DiscardRequest, followed
by `wake.set()` (an idle worker sleeps in `wake.wait()`: no polling), and each request's own queue of
events, Accepted, a CompletionDelta per step that sampled for it, then Done or Error. A handler that
stops early calls `release()`, which queues a discard: the worker frees the request's KV blocks before
its next step. Handlers read the scheduler's stats as the worker's snapshot after each step; while
someone watches /engine/events, the worker publishes an event per step (engine_events.py).

A step that fails fails the requests in flight, and the worker serves on: the next request may well
work. The step is all the worker does for requests: the scheduler's step and the handing out of its
tokens, text and finishes, a discard, the live view's events (an admission that fails fails only its own
request). Each failure is logged with its traceback. Some failures leave nothing to serve on with: a sticky
CUDA error (device_errors.py), after which no later step can run; a failed step that leaves KV blocks no
discard could free; a bug in the worker's loop itself. Then the worker stops, as it does if it dies any
other way; `/health` answers 503 and `on_death` tells the server's main thread, which exits non-zero for a
supervisor to restart the process.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from ..engine.sampling_params import SamplingParams
from ..engine.request_check import CheckedRequest
from ..engine.scheduler import OnlineScheduler
from ..device_errors import is_sticky_device_error
from ..errors import InvalidParameter
from .api_errors import APIError
from .engine_events import EngineFeed, EventRecorder
from .messages import Accepted, AddRequest, DiscardRequest, Done, Error, RequestHandle
from .metrics import Metrics

log = logging.getLogger("minfer.serve")


class EngineError(APIError):
    """A request the manager could not take (queue full: 429; engine stopped: 503): the HTTP error as it is."""


def check_max_queued(max_queued, name: str = "max_queued") -> None:
    """A ValueError naming `name` (the server's flag is --max-queued) unless it is a whole number of requests."""
    if not isinstance(max_queued, int) or max_queued < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {max_queued!r}")


class SchedulerManager:
    def __init__(self, scheduler: OnlineScheduler, metrics: Metrics | None = None, max_queued: int = 128):
        check_max_queued(max_queued)
        self.scheduler = scheduler  # the worker's alone once start() has run
        self.metrics = metrics or Metrics()
        # Up to max_num_seqs requests run at once; max_queued more may wait for a slot.
        self.max_in_flight = scheduler.max_num_seqs + max_queued
        self._inbox: deque[AddRequest | DiscardRequest] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the fields below
        self._released = threading.Condition(self._lock)
        self._in_flight = 0  # submitted and not yet released by their handler
        self._stopping = False
        self._dead = False
        self.died_because: str | None = None  # why the worker stopped without being asked to
        self.on_death: Callable[[], None] | None = None  # called once the worker has died (serve.py exits)
        self._ids = itertools.count()
        self._active: dict[str, RequestHandle] = {}  # worker thread only: requests in the scheduler
        self._stats = scheduler.stats()  # replaced (never mutated) by the worker
        self.events = EngineFeed(wake=self._wake.set)  # viewers subscribe here, from any thread
        self._recorder = EventRecorder(scheduler)  # worker thread only
        self._thread = threading.Thread(target=self._run, name="minfer-engine", daemon=True)

    # ---- called from handler threads --------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    def stats(self) -> dict:
        """The scheduler's stats as of the worker's last step."""
        return self._stats

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """The scheduler's own check that a request could ever run (InvalidParameter naming the field if
        not). It reads only fixed limits, so it runs in the caller's thread, once, before submit."""
        return self.scheduler.check_request(prompt_token_ids, params)

    def submit(self, request: CheckedRequest) -> RequestHandle:
        """Hand a checked request to the worker. Its first event is Accepted, or Error if the scheduler
        refused it. Raises EngineError when the engine cannot take it (queue full: 429; stopped: 503)."""
        with self._lock:
            if self._stopping or self._dead:
                raise EngineError(503, "the engine has stopped" if self._dead else "the server is shutting down")
            if self._in_flight >= self.max_in_flight:
                self.metrics.on_rejected()
                raise EngineError(429, f"too many requests: {self._in_flight} are already in flight; retry later")
            self._in_flight += 1
            handle = RequestHandle(str(next(self._ids)), request)
            self._inbox.append(AddRequest(handle))  # under the lock: the worker's last drain can't miss it
        self._wake.set()
        return handle

    def release(self, handle: RequestHandle) -> None:
        """The handler is done with the request; if it has not finished, the worker discards it."""
        if not handle.finished:
            self._inbox.append(DiscardRequest(handle))
            self._wake.set()
        with self._lock:
            self._in_flight -= 1
            self._released.notify_all()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the worker: every request still in flight gets an Error (503) event."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def wait_released(self, timeout: float) -> bool:
        """Wait until every handler has released its request (written its last bytes)."""
        with self._released:
            return self._released.wait_for(lambda: self._in_flight == 0, timeout)

    # ---- the worker thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before draining: a submit after this point sets it again
                queues_changed = self._drain_inbox()
                if self._stopping:
                    break
                if self.events.active:
                    self._guarded(self._recorder.between_steps, self.events, queues_changed)
                if not self.scheduler.has_unfinished():
                    self._read_stats()
                    self._wake.wait()  # idle: sleep until a handler adds or discards something
                    continue
                self._step()
                self._read_stats()
        except BaseException as e:
            log.exception("the engine worker died")
            self.died_because = self.died_because or f"the engine worker died: {type(e).__name__}"
        finally:
            with self._lock:
                self._dead = not self._stopping
                self._stopping = True  # submit() refuses from now on
            message = "the engine has stopped" if self._dead else "the server is shutting down"
            try:
                self._drain_inbox(refuse=message)
            finally:  # whatever state the scheduler is in, no handler may be left waiting
                self._fail_all(503, message)
                self._stats = self.scheduler.stats()
                self.events.close()
                self._close_scheduler()
                if self._dead and self.on_death is not None:
                    self.on_death()

    def _drop(self, request_id: str) -> None:
        """Discard a request after a failure, which may have left the scheduler in a bad state: this may fail too."""
        try:
            self.scheduler.discard_request(request_id)
        except Exception:
            log.exception("could not discard request %s", request_id)

    def _close_scheduler(self) -> None:
        """CUDA graphs and their memory, freed by the thread that ran them; after a sticky CUDA error that may
        fail too, and the process is on its way out anyway."""
        try:
            self.scheduler.close()
        except Exception:
            log.exception("closing the engine failed")

    def _drain_inbox(self, refuse: str | None = None) -> bool:
        """Admit new requests (or refuse them with a 503 `refuse` message) and carry out discards.
        Returns whether there was anything to do."""
        busy = bool(self._inbox)
        while self._inbox:
            message = self._inbox.popleft()
            handle = message.handle
            if isinstance(message, AddRequest) and refuse is not None:
                handle.events.put(Error(503, refuse))
            elif isinstance(message, AddRequest):
                self._add(handle)
            elif handle.request_id in self._active:  # a discard of a live request
                self._guarded(self._discard, handle.request_id)
        return busy

    def _add(self, handle: RequestHandle) -> None:
        """Admit a request. One the scheduler refuses gets a 400; one whose admission fails otherwise, a 500. Either
        way, whatever part of it the scheduler took is dropped: a request half added would run with no handle."""
        request_id = handle.request_id
        try:
            self.scheduler.add_request(handle.request, request_id=request_id, arrival_time=handle.arrival_time)
            self._active[request_id] = handle
            self.metrics.on_admitted(len(handle.request.prompt_token_ids))
            handle.events.put(Accepted())
        except Exception as e:
            refused = isinstance(e, InvalidParameter)  # the scheduler's refusal, naming its field; else a bug
            if not refused:
                log.exception("could not admit request %s", request_id)
            self._active.pop(request_id, None)
            self._drop(request_id)
            handle.events.put(Error(400, str(e)) if refused else Error(500, "the engine failed to admit this request"))

    def _discard(self, request_id: str) -> None:
        self.scheduler.discard_request(request_id)
        del self._active[request_id]  # only now: if the discard failed, the failure discards it (_fail_all)
        self.metrics.on_aborted()

    def _guarded(self, work: Callable, *args) -> None:
        """Run work on the requests in flight (a step, a discard, the live view's events); if it fails, the
        failure is a failed step (_step_failed). The loop's own calls stay outside: a bug there ends the worker."""
        try:
            work(*args)
        except Exception as e:
            self._step_failed(e)

    def _read_stats(self) -> None:
        """The stats snapshot handlers read; if reading it fails, the last one stays: requests need none of it."""
        try:
            self._stats = self.scheduler.stats()
        except Exception:
            log.exception("could not read the engine's stats")

    def _step(self) -> None:
        """One step, then its tokens, text and finishes handed to the requests' queues; a failure anywhere in
        either is a failed step."""
        self._guarded(self._step_and_hand_out)

    def _step_and_hand_out(self) -> None:
        sampled = self.scheduler.step()
        num_tokens, now = 0, time.perf_counter()
        for request_id in sampled:  # text "" too: the handler still gets the step's token ids
            handle = self._active[request_id]
            for delta in self.scheduler.get_new_outputs(request_id):  # one per choice that sampled
                num_tokens += len(delta.token_ids)  # n per request, accepted proposals too
                handle.events.put(delta)
            if not handle.sampled:  # its first token: counted now, whether it will finish or be discarded
                handle.sampled = True
                self.metrics.on_first_token(now - handle.arrival_time)
        self.metrics.on_tokens(num_tokens)
        finished = []
        for request_id in self.scheduler.pop_finished_ids():
            outs = self.scheduler.pop_responses(request_id)  # one per choice
            self.metrics.on_finished(outs[0])
            self._active[request_id].events.put(Done(tuple(outs)))
            del self._active[request_id]  # only once Done is out: until then a failure answers it (_fail_all)
            finished += outs
        if self.events.active:
            self.events.publish(self._recorder.step(num_tokens, finished))

    def _step_failed(self, e: Exception) -> None:
        """Fail what was in flight, free it, and keep serving: the next request may well work. After a sticky
        CUDA error, or if what was in flight cannot all be freed, the worker stops (see the module's docstring)."""
        if is_sticky_device_error(e):
            self.died_because = f"a sticky CUDA error: {str(e).strip().splitlines()[0]}"
            raise e
        log.exception("engine step failed; failing %d in-flight requests", len(self._active))
        self._drop_all()
        allocator = self.scheduler.allocator
        if self.scheduler.has_unfinished() or allocator.num_free_blocks != allocator.num_blocks:
            # what no request holds any more is lost for good: a worker serving on would fail or shrink forever.
            # The wind-down answers its requests once the worker is marked dead, as /health will then say.
            self.died_because = "a failed step left KV blocks or sequences that could not be freed"
            raise RuntimeError(self.died_because) from e
        self._answer_all(500, "the engine failed while running this request")
        if self.events.active:
            self.events.publish(self._recorder.update())

    def _fail_all(self, status: int, message: str) -> None:
        """Discard every request in flight and answer each with an Error (the wind-down's last word)."""
        self._drop_all()
        self._answer_all(status, message)

    def _drop_all(self) -> None:
        """Discard every request in flight after a failure; they stay in `_active` until answered."""
        for request_id in self._active:
            self._drop(request_id)

    def _answer_all(self, status: int, message: str) -> None:
        for handle in self._active.values():
            handle.events.put(Error(status, message))
        self.metrics.on_aborted(len(self._active))
        self._active.clear()
