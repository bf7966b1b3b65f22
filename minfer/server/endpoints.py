"""The server's endpoints, and how a handler thread talks to the engine.

A request to /v1/completions, /v1/chat/completions or /generate is parsed (requests.py,
chat_requests.py), checked by the engine once, in this thread (a 400 naming the field before anything
is streamed), submitted, and its events (messages.py) written out by the Responder as one JSON body or
Server-Sent Events (/generate: plain chunked text). Whatever happens, the request is released at the
end: if it has not finished (the client left, a write failed), the worker discards it and frees its KV
blocks before its next step.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import replace

from ..engine.outputs import RequestOutput
from ..engine.request_check import CheckedRequest
from ..errors import InvalidParameter
from .api_errors import APIError
from .chat_requests import parse_chat
from .http_handler import ClientGone
from .info_endpoints import InfoEndpoints, ServerState
from .messages import CompletionDelta, Done, Error, RequestEvent, RequestHandle
from .generate_requests import parse_generate
from .requests import ParsedRequest, invalid_request, parse_completion
from .responder import Responder, generate_response

log = logging.getLogger("minfer.serve")


def _at_index(e: APIError, index: int) -> APIError:
    """An error about one prompt of a batch names which: param 'prompt[3]'."""
    if e.param != "prompt":
        return e
    return APIError(e.status, f"prompt[{index}]: {e.message}", param=f"prompt[{index}]", code=e.code)


CLIENT_CHECK_SECONDS = 0.5  # while a request waits without output, check this often whether its client left


class APIHandler(InfoEndpoints):
    """Every route of the server: the endpoints that generate are here; the others come from
    InfoEndpoints (info_endpoints.py)."""

    server: ServerState

    ROUTES = {
        "/health": ("GET", "health", False),
        "/metrics": ("GET", "metrics", False),
        "/v1/models": ("GET", "models", True),
        "/v1/models/{id}": ("GET", "model", True),
        "/version": ("GET", "version", False),
        "/v1/completions": ("POST", "completions", True),
        "/v1/chat/completions": ("POST", "chat_completions", True),
        "/generate": ("POST", "generate", True),
        "/tokenize": ("POST", "tokenize", True),
        "/detokenize": ("POST", "detokenize", True),
        "/tokenizer_info": ("GET", "tokenizer_info", True),
        "/": ("GET", "live_page", False),  # the page holds no data: the feed it reads needs the key
        "/engine/events": ("GET", "engine_events", True),
    }

    def route_of(self, path: str) -> str:
        return "/v1/models/{id}" if path.startswith("/v1/models/") else path

    # ---- talking to the engine ---------------------------------------------------------

    @contextmanager
    def _submitted(self, req: ParsedRequest):
        """Check every prompt of the request against the engine (one it refuses refuses them all), submit
        each as an engine request of its own, wait until all are admitted; always release them afterwards."""
        manager = self.server.manager
        if len(req.prompts) > manager.max_in_flight:  # never room for it: a 429 "retry later" is retried forever
            raise APIError(400, f"a batch of {len(req.prompts)} prompts is more than this server holds at once "
                           f"({manager.max_in_flight}: --max-num-seqs + --max-queued): send them in smaller batches",
                           param="prompt", code="invalid_value")
        checked = [self._checked(req, i) for i in range(len(req.prompts))]  # before anything is streamed
        handles, self._client_check_due = [], time.monotonic() + CLIENT_CHECK_SECONDS  # see _next_event
        # The log line's token counts: every prompt submitted, every token handed out, however the request ends
        self._prompt_tokens = self._completion_tokens = 0
        try:
            for request in checked:
                handles.append(manager.submit(request))  # EngineError (an APIError) when it cannot take it
                self._prompt_tokens += len(request.prompt_token_ids)
            for handle in handles:
                self._next_event(handle)  # Accepted (a refusal raises)
            yield handles
        finally:
            for handle in handles:
                manager.release(handle)  # discards it if it has not finished
            if handles:
                self.log_note = f"tokens={self._prompt_tokens}+{self._completion_tokens} "

    def _checked(self, req: ParsedRequest, i: int) -> CheckedRequest:
        try:
            return self.server.manager.check(req.prompts[i], req.params)
        except InvalidParameter as e:  # the prompt does not fit the model: a 400 naming the field
            if req.tools is not None and e.param == "structured_outputs" and req.fields.get(e.param) == "tools":
                e = req.tools.fault(e, lambda c: self.server.manager.check(
                    req.prompts[i], replace(req.params, structured_outputs=c)))
            error = invalid_request(e, req.fields)
            raise (_at_index(error, i) if len(req.prompts) > 1 else error) from None

    def _next_event(self, handle: RequestHandle) -> RequestEvent:
        """The request's next event (an Error raises APIError), checking now and then whether the client left."""
        while True:
            event = handle.next_event(timeout=CLIENT_CHECK_SECONDS)
            if isinstance(event, Error):
                raise APIError(event.status, event.message)
            if event is None and not self.server.manager.is_alive():  # it died and never answered this one
                raise APIError(503, "the engine has stopped")
            if (event is None or time.monotonic() > self._client_check_due) and self._client_left():  # events or not
                raise ClientGone()
            if event is not None:
                return event

    def _client_left(self) -> bool:
        """Has the client closed its socket? A request that writes nothing until its end would never notice
        otherwise. The next look is due CLIENT_CHECK_SECONDS from now."""
        self._client_check_due = time.monotonic() + CLIENT_CHECK_SECONDS
        return self.client_gone()

    def _events(self, handle: RequestHandle):
        """Yield each CompletionDelta as it comes, then the RequestOutputs (a tuple, one per choice)."""
        while True:
            match self._next_event(handle):
                case CompletionDelta() as delta:
                    self._completion_tokens += len(delta.token_ids)
                    yield delta
                case Done() as done:
                    yield done.outputs
                    return

    def _collect(self, handle: RequestHandle) -> tuple[RequestOutput, ...]:
        *_, outputs = self._events(handle)  # their texts are the whole texts: the deltas are not needed
        return outputs

    # ---- endpoints -----------------------------------------------------------------

    def handle_completions(self) -> None:
        self._openai(parse_completion(self.read_json(), self.server.info), chat=False)

    def handle_chat_completions(self) -> None:
        self._openai(parse_chat(self.read_json(), self.server.info), chat=True)

    def _openai(self, req: ParsedRequest, chat: bool) -> None:
        with self._submitted(req) as handles:
            # Only now that the engine has judged n: the Responder keeps state per choice
            r = Responder(self.server.info.name, chat, req, self.server.info.tokenizer)
            if req.stream:
                self._send_stream(r, req, handles)
            else:
                self.send_json(200, r.response([self._collect(h) for h in handles]))

    def _send_stream(self, r: Responder, req: ParsedRequest, handles: list[RequestHandle]) -> None:
        # /engine/events' id for the request: the live view's playground highlights its blocks by it
        self.begin_stream("text/event-stream", {"X-Engine-Request-Id": handles[0].request_id})
        outs = []
        try:
            for chunk in r.first_chunks():
                self.send_event(chunk)
            for prompt_index, handle in enumerate(handles):  # run together, streamed one prompt after another
                for item in self._events(handle):
                    if isinstance(item, CompletionDelta):  # a choice's text; its finish_reason on its last
                        for chunk in r.delta_chunks(item, prompt_index):
                            self.send_event(chunk)
                    else:
                        outs.append(item)  # the prompt's choices, one RequestOutput each
            if req.include_usage:
                self.send_event(r.usage_chunk(outs))
        except APIError as e:  # the engine failed or is shutting down: say so, then end the stream
            self._cut_stream(e)
        except OSError:  # the client left, or stopped reading: nothing more can be sent
            raise
        except Exception:  # a bug: the client gets the 500 route_request would send, as the stream's error event
            log.exception("error while streaming %s %s", self.command, self.path)
            self._cut_stream(APIError(500, "internal server error"))
        self.send_event("[DONE]")
        self.end_stream()

    def _cut_stream(self, error: APIError) -> None:
        self.note_cut_stream(error)
        self.send_event(error.body())

    def handle_generate(self) -> None:
        req = parse_generate(self.read_json(), self.server.info)
        with self._submitted(req) as (handle,):
            if not req.stream:
                (out,) = self._collect(handle)  # /generate has n = 1
                self.send_json(200, generate_response(out))
                return
            self.begin_stream("text/plain; charset=utf-8")
            try:
                for item in self._events(handle):
                    if isinstance(item, CompletionDelta) and item.text:  # an empty chunk would end the body
                        self.write_chunk(item.text.encode())
            except APIError as e:  # plain text has no error frame: end without the last chunk, so it reads as cut
                self.note_cut_stream(e)
                self.close_connection = True
                return
            self.end_stream()
