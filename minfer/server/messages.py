"""The messages between HTTP handler threads and the engine worker (manager.py), one small type each.

Handler -> worker, through the manager's inbox:

    AddRequest(handle)       run this request
    DiscardRequest(handle)   its handler stopped early: drop it and free its KV blocks

Worker -> handler, through the request's own queue (RequestHandle.events), in this order:

    Accepted()               the scheduler took the request
    CompletionDelta(index, token_ids, text, finish_reason, logprobs)
                             ... one per step that sampled a token for it: the new token ids and
                             the text they added (may be "": held back, or a stop token's)
    Done(outputs)            the request finished: its RequestOutput per choice (whose text is the whole text)
 or Error(status, message)   it failed (or the server is stopping): an HTTP status and a sentence

Only the worker calls the scheduler; these are all the two sides say to each other. CompletionDelta
is the engine's own record (engine/sequence.py), sent as it is, with everything the engine says per
step: the tokens' logprobs when asked (scoring/), and, for a request with n > 1, which completion it
is (index), one delta per completion that sampled.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from ..engine.request_check import CheckedRequest
from ..engine.outputs import CompletionDelta, RequestOutput


@dataclass(frozen=True)
class AddRequest:
    handle: RequestHandle


@dataclass(frozen=True)
class DiscardRequest:
    handle: RequestHandle


@dataclass(frozen=True)
class Accepted:
    pass


@dataclass(frozen=True)
class Done:
    outputs: tuple[RequestOutput, ...]  # every choice's, in index order (n of them)


@dataclass(frozen=True)
class Error:
    status: int  # 400: the scheduler refused it; 500: the engine failed; 503: the engine stopped
    message: str


RequestEvent = Accepted | CompletionDelta | Done | Error


class RequestHandle:
    """One submitted request, as its HTTP handler sees it."""

    def __init__(self, request_id: str, request: CheckedRequest):
        self.request_id = request_id
        self.request = request  # the prompt's ids and the SamplingParams, checked by the engine
        # Submitted now: its latencies count from here, not from when a busy worker takes it from the inbox
        self.arrival_time = time.perf_counter()
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # filled by the worker only
        self.finished = False  # the handler has read Done or Error: nothing left to discard
        self.sampled = False  # the worker has sampled its first token (the worker's alone)

    def next_event(self, timeout: float | None = None) -> RequestEvent | None:
        """The next event, or None if none came within `timeout` seconds."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, (Done, Error)):
            self.finished = True
        return event
