"""`python -m minfer.serve`: an OpenAI-compatible streaming HTTP server on the standard library.

    python -m minfer.serve --model gpt2 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 20, "stream": true}'

Threads: ThreadingHTTPServer gives each connection a handler thread. A handler
parses, validates and tokenizes the request (openai_api.py), submits it to the
SchedulerManager (manager.py), whose single worker thread runs the engine, and
reads text pieces back from the request's queue, writing each one as it comes:
Server-Sent Events for the OpenAI endpoints, plain chunked text for /generate.
If the client goes away, the handler releases the request and the worker frees
its KV blocks before the next step. connections.py bounds the rest: request,
keep-alive and write timeouts, and a cap on connections (see its docstring for
the defaults and why).

Endpoints: GET /health, GET /metrics, GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, POST /generate, and the live view: GET / (a page)
and GET /engine/events (live_view.py). With --api-key, the /v1 endpoints,
/generate and /engine/events need `Authorization: Bearer KEY`; /health and
/metrics stay open for probes and scrapers, and the page asks for the key.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import torch

from . import __version__, live_view
from .connections import CappedHTTPServer, ConnectionLimits, TimedHandler, add_arguments, limits_from_args
from .engine import resolve_dtype, set_cpu_threads
from .manager import ACCEPTED, DONE, ERROR, TEXT, EngineError, RequestHandle, SchedulerManager
from .metrics import Metrics
from .chat_template import ChatTemplate
from .models import load_model
from .openai_api import (
    APIError,
    ModelInfo,
    ParsedRequest,
    Responder,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json_body,
    usage,
)
from .scheduler import OnlineScheduler
from .sequence import RequestOutput
from .tokenizer import Tokenizer

log = logging.getLogger("minfer.serve")

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than a 1024-token context needs
CLIENT_CHECK_SECONDS = 0.5  # while a request waits without output, check this often whether its client left


class ClientGone(ConnectionError):
    """The client closed the connection; nothing more can be sent."""


class MinferServer(CappedHTTPServer):
    request_queue_size = 128  # the listen backlog; socketserver's default of 5 resets bursts of clients

    def __init__(
        self,
        address,
        manager: SchedulerManager,
        info: ModelInfo,
        api_key: str | None = None,
        limits: ConnectionLimits | None = None,
    ):
        self.manager = manager
        self.info = info
        self.api_key = api_key
        self.started = int(time.time())
        super().__init__(address, Handler, limits or ConnectionLimits(), self.health)

    def health(self) -> tuple[int, dict]:
        """(status, body) of GET /health; also answered at the connection cap."""
        if self.manager.is_alive():
            return 200, {"status": "ok"}
        return 503, {"status": "unavailable", "reason": "the engine worker is not running"}

    def stop(self, grace: float = 3.0) -> None:
        """Graceful shutdown: fail in-flight requests (streams get an error chunk), stop accepting, and
        give handlers `grace` seconds to write their last bytes. Call from a thread other than serve_forever's."""
        self.manager.shutdown()
        self.shutdown()  # serve_forever returns within its 0.5 s poll interval
        self.server_close()
        self.manager.wait_released(grace)


class Handler(TimedHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked transfer encoding for streams
    server_version = f"minfer/{__version__}"
    server: MinferServer

    # path -> (method, handler method, needs the API key)
    ROUTES = {
        "/health": ("GET", "health", False),
        "/metrics": ("GET", "metrics", False),
        "/v1/models": ("GET", "models", True),
        "/v1/completions": ("POST", "completions", True),
        "/v1/chat/completions": ("POST", "chat_completions", True),
        "/generate": ("POST", "generate", True),
        "/": ("GET", "live_page", False),  # the page holds no data: the feed it reads needs the key
        "/engine/events": ("GET", "engine_events", True),
    }

    # ---- routing, errors, logging --------------------------------------------------

    def do_GET(self) -> None:
        self._start = time.perf_counter()
        self._status: int | str = "-"
        self._tokens = ""
        self._streaming = False  # the handler serves every request of a keep-alive connection
        path = urlsplit(self.path).path
        try:
            if path not in self.ROUTES:
                raise APIError(404, f"no such endpoint: {path}", code="not_found")
            method, name, needs_key = self.ROUTES[path]
            if self.command != method:
                raise APIError(
                    405,
                    f"{path} accepts {method} only, not {self.command}",
                    code="method_not_allowed",
                    headers={"Allow": method},
                )
            if needs_key:
                self._authorize()
            getattr(self, "handle_" + name)()
        except APIError as e:
            self._send_error_json(e)
        except ConnectionError:  # BrokenPipe, ConnectionReset, ClientGone: nobody left to answer
            self.close_connection = True
            self._status = f"{self._status} client-gone"
        except Exception:  # a bug: log it, tell the client as little as possible, keep serving
            log.exception("error while handling %s %s", self.command, path)
            self._send_error_json(APIError(500, "internal server error"))
        finally:
            took = time.perf_counter() - self._start
            log.info(
                '%s "%s %s" %s %s%.3fs', self.client_address[0], self.command, path, self._status, self._tokens, took
            )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET  # routing decides (404 / 405)

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def _send_error_json(self, e: APIError) -> None:
        self.close_connection = True  # the request body may be unread: don't reuse the connection
        if not self._streaming:  # once a stream's headers are out, ending the connection is all we can do
            try:
                self._send_json(e.status, e.body(), e.headers)
            except OSError:
                pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (malformed request line, unsupported method...) as JSON, too."""
        self.close_connection = True
        self._status = code
        if self.command == "HEAD" or code < 200 or code in (204, 304):  # no body allowed
            return super().send_error(code, message, explain)
        self._send_json(code, APIError(code, message or "bad request").body())
        log.info('%s "%s" %s', self.client_address[0], self.requestline, code)

    def log_request(self, code="-", size="-") -> None:
        pass  # do_GET logs one line per request, with tokens and time

    def log_message(self, format: str, *args) -> None:
        log.warning("%s %s", self.client_address[0], format % args)

    # ---- plumbing ------------------------------------------------------------------

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def _read_json(self) -> dict:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise APIError(411, "chunked request bodies are not supported: send a Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            raise APIError(411, "a Content-Length header is required")
        if not length.isdigit():
            raise APIError(400, f"bad Content-Length {length!r}")
        if int(length) > MAX_BODY_BYTES:
            raise APIError(
                413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}", code="request_too_large"
            )
        raw = self.rfile.read(int(length))
        if len(raw) < int(length):
            raise ClientGone()
        return parse_json_body(raw)

    def _send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _begin_stream(self, content_type: str, headers: dict | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._streaming = True

    def _write_chunk(self, data: bytes) -> None:
        """One HTTP chunk; a write to a vanished client raises BrokenPipe/ConnectionReset."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def _sse(self, obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self._write_chunk(f"data: {data}\n\n".encode())

    def _client_gone(self) -> bool:
        """Has the client closed its end? Readable with nothing to read means EOF."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    @contextmanager
    def _submitted(self, req: ParsedRequest):
        """Submit to the engine and wait until it is admitted; always release it afterwards."""
        try:
            handle = self.server.manager.submit(req.prompt_token_ids, req.params)
        except EngineError as e:
            raise APIError(e.status, e.message) from None
        try:
            event = self._next_event(handle)
            if event[0] == ERROR:
                raise APIError(event[1], event[2])
            assert event[0] == ACCEPTED, event
            yield handle
        finally:
            self.server.manager.release(handle)  # discards it if it has not finished

    def _next_event(self, handle: RequestHandle) -> tuple:
        while True:
            event = handle.next_event(timeout=CLIENT_CHECK_SECONDS)
            if event is not None:
                return event
            if self._client_gone():
                raise ClientGone()

    def _events(self, handle: RequestHandle):
        """Yield each text piece (str) as it comes, then the RequestOutput; an ERROR event raises APIError."""
        while True:
            event = self._next_event(handle)
            if event[0] == TEXT:
                yield event[1]
            elif event[0] == DONE:
                self._tokens = "tokens={prompt_tokens}+{completion_tokens} ".format(**usage(event[1]))
                yield event[1]
                return
            else:
                raise APIError(event[1], event[2])

    def _collect(self, handle: RequestHandle) -> RequestOutput:
        for item in self._events(handle):
            if isinstance(item, RequestOutput):  # its text is the whole text: the pieces are not needed
                return item
        raise AssertionError("the event stream ended without DONE")

    # ---- endpoints -----------------------------------------------------------------

    def handle_health(self) -> None:
        self._send_json(*self.server.health())

    def handle_models(self) -> None:
        info = self.server.info
        model = {
            "id": info.name,
            "object": "model",
            "created": self.server.started,
            "owned_by": "minfer",
            "max_model_len": info.max_model_len,
        }
        self._send_json(200, {"object": "list", "data": [model]})

    def handle_metrics(self) -> None:
        text = self.server.manager.metrics.render(self.server.manager.stats()) + self.server.stats.render()
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def handle_live_page(self) -> None:
        self._send(200, live_view.page(), "text/html; charset=utf-8")

    def handle_engine_events(self) -> None:
        self._begin_stream("text/event-stream")
        live_view.stream_events(self.server.manager.events, self._write_chunk, self._client_gone)
        self._end_stream()

    def handle_completions(self) -> None:
        self._openai(parse_completion(self._read_json(), self.server.info), chat=False)

    def handle_chat_completions(self) -> None:
        self._openai(parse_chat(self._read_json(), self.server.info), chat=True)

    def _openai(self, req: ParsedRequest, chat: bool) -> None:
        r = Responder(self.server.info.name, chat)
        with self._submitted(req) as handle:
            if not req.stream:
                self._send_json(200, r.response(self._collect(handle)))
                return
            # The engine's id for this request, as /engine/events names it: the live view's playground
            # highlights its own request's blocks with it.
            self._begin_stream("text/event-stream", {"X-Engine-Request-Id": handle.request_id})
            for chunk in r.first_chunks():
                self._sse(chunk)
            try:
                for item in self._events(handle):
                    if isinstance(item, str):
                        self._sse(r.text_chunk(item))
                        continue
                    self._sse(r.final_chunk(item.finish_reason))
                    if req.include_usage:
                        self._sse(r.usage_chunk(item))
            except APIError as e:  # the engine failed or is shutting down: say so, then end the stream
                self._sse(e.body())
            self._sse("[DONE]")
            self._end_stream()

    def handle_generate(self) -> None:
        req = parse_generate(self._read_json(), self.server.info)
        with self._submitted(req) as handle:
            if not req.stream:
                out = self._collect(handle)
                self._send_json(200, {"text": out.text, "finish_reason": out.finish_reason, "usage": usage(out)})
                return
            self._begin_stream("text/plain; charset=utf-8")
            try:
                for item in self._events(handle):
                    if isinstance(item, str):
                        self._write_chunk(item.encode())
            except APIError:  # plain text has no error frame: end without the last chunk, so it reads as cut
                self.close_connection = True
                return
            self._end_stream()


# ---- building and running the server -------------------------------------------------


def create_server(
    model: str = "gpt2",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "cpu",
    dtype: str = "float32",
    num_kv_blocks: int | None = None,
    max_num_seqs: int = 64,
    max_queued: int = 128,
    api_key: str | None = None,
    served_model_name: str | None = None,
    limits: ConnectionLimits | None = None,
) -> MinferServer:
    """Load the model, start the engine worker and bind the socket (port 0 picks a free port).
    Raises ValueError/OSError for a bad model, setting or address. Run it with serve_forever()."""
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"bad device {device!r}: {e}") from None
    model_ = load_model(model, device=device, dtype=resolve_dtype(dtype, device))
    tokenizer = Tokenizer.from_dir(model_.model_dir)
    scheduler = OnlineScheduler(model_, tokenizer, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs)
    chat_template = ChatTemplate.from_dir(model_.model_dir, tokenizer)
    info = ModelInfo(
        served_model_name or model, tokenizer, model_.config.vocab_size, scheduler.max_model_len, chat_template
    )
    manager = SchedulerManager(scheduler, Metrics(), max_queued=max_queued)
    server = MinferServer((host, port), manager, info, api_key, limits)  # binds now: a taken port fails here
    manager.start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="local checkpoint directory or Hub repo id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, or auto (bf16 where fast)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: auto)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    parser.add_argument("--max-queued", type=int, default=128, help="requests that may wait for a slot; more get 429")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MINFER_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $MINFER_API_KEY, else none)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    add_arguments(parser)  # timeouts and the connection cap
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    if args.device == "cpu" or args.device.startswith("cpu:"):
        set_cpu_threads()  # as LLM does, before the model loads
    try:
        server = create_server(
            args.model,
            host=args.host,
            port=args.port,
            device=args.device,
            dtype=args.dtype,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_queued=args.max_queued,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            limits=limits_from_args(args),
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    threading.Thread(target=server.serve_forever, name="minfer-http", daemon=True).start()
    host, port = server.server_address[:2]
    print(f"minfer: serving {server.info.name!r} on http://{host}:{port} (Ctrl-C to stop)", flush=True)
    stop.wait()  # the main thread only waits for a signal
    log.info("shutting down")
    server.stop(grace=3.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
