"""The HTTP side of one request: route it by path, read its JSON body, write JSON, a chunked stream or
Server-Sent Events, and turn every error into an OpenAI-style JSON reply.

RoutingHandler knows nothing of the engine: a subclass (endpoints.py) names its
routes in ROUTES and implements a `handle_<name>` method for each. The
standard library calls `do_<METHOD>` for each request; every method goes to
`route_request`, which answers 404 for an unknown path and 405 for a known path
asked with the wrong method; HEAD on a GET route gets the GET's headers, without its
body. Timeouts and the connection cap come from the TimedHandler base (connections.py).
"""

from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import time
from urllib.parse import urlsplit

from .api_errors import APIError
from ..errors import whole_number
from ..version import __version__
from .connections import TimedHandler
from .requests import parse_json_body

log = logging.getLogger("minfer.serve")

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than a 1024-token context needs


class ClientGone(ConnectionError):
    """The client closed the connection; nothing more can be sent."""


class RoutingHandler(TimedHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and chunked transfer encoding for streams
    server_version = f"minfer/{__version__}"

    # path -> (method, name of its handle_<name> method, whether it needs the API key); set by a subclass
    ROUTES: dict[str, tuple[str, str, bool]] = {}
    _body_unread = False  # route_request sets it per request

    # ---- routing, errors, logging --------------------------------------------------

    def route_request(self) -> None:
        """Serve one request, whatever its method: find its route, check method and key, run the endpoint."""
        start, path = time.perf_counter(), urlsplit(self.path).path
        self._status: int | str = "-"
        self.log_note = ""  # words for this request's log line: the endpoint adds the token counts
        self._streaming = False  # the handler serves every request of a keep-alive connection
        lengths = set(self.headers.get_all("Content-Length") or ()) - {"0"}  # until read_json reads a body, the
        self._body_unread = bool(lengths) or "Transfer-Encoding" in self.headers  # next request would start in it
        try:
            route, meant = self.route_of(path), path.rstrip("/")
            if meant != path and self.route_of(meant) in self.ROUTES:  # before route: "/v1/models/" is no model id
                raise APIError(404, f"no such endpoint: {path} (did you mean {meant}?)", code="not_found")
            if route not in self.ROUTES:
                raise APIError(404, f"no such endpoint: {path}", code="not_found")
            method, name, needs_key = self.ROUTES[route]
            if self.command != method and (self.command, method) != ("HEAD", "GET"):  # HEAD: a GET's headers
                raise APIError(405, f"{path} accepts {method} only, not {self.command}", code="method_not_allowed",
                               headers={"Allow": "GET, HEAD" if method == "GET" else method})
            if needs_key and self.server.api_key is not None:
                self.authorize(self.server.api_key)
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
            if getattr(self.server, "log_requests", True):
                log.info('%s "%s %s" %s %s%.3fs', self.client_address[0], self.command, path, self._status,
                         self.log_note, time.perf_counter() - start)

    def route_of(self, path: str) -> str:
        """The ROUTES key serving `path`: the path itself, unless a subclass maps a family of paths."""
        return path

    # http.server calls do_<METHOD>; the routes decide what each method may do (404 / 405)
    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = route_request

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def _send_error_json(self, e: APIError) -> None:
        # A 4xx leaves the connection usable (clients pool theirs); _send_headers closes it if the body is unread
        self.close_connection = self.close_connection or self._streaming or e.status >= 500
        if not self._streaming:  # once a stream's headers are out, ending the connection is all we can do
            try:
                self.send_json(e.status, e.body(), e.headers)
            except OSError:
                pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (malformed request line, unsupported method...) as JSON, too."""
        self.close_connection = True
        self._status = code
        if self.command == "HEAD" or code < 200 or code in (204, 304):  # no body allowed
            return super().send_error(code, message, explain)
        self.send_json(code, APIError(code, message or "bad request").body())
        log.info('%s "%s" %s', self.client_address[0], self.requestline, code)

    def log_request(self, code="-", size="-") -> None:
        pass  # route_request logs one line per request, with tokens and time

    def log_message(self, format: str, *args) -> None:
        log.warning("%s %s", self.client_address[0], format % args)

    # ---- reading and writing ---------------------------------------------------------

    def authorize(self, key: str) -> None:
        """The request must carry `Authorization: Bearer <key>`; else a 401."""
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def read_json(self) -> dict:
        size = self._body_size()
        try:
            raw = self.rfile.read(size)
        except (APIError, OSError):  # a timeout (408) or a vanished client: the rest of the body is not for reading
            self.close_connection = True
            raise
        if len(raw) < size:
            raise ClientGone()
        self._body_unread = False
        return parse_json_body(raw)

    def _body_size(self) -> int:
        """The body's length, from its one Content-Length; an APIError where none frames a body this server reads."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise APIError(411, "chunked request bodies are not supported: send a Content-Length")
        lengths = set(self.headers.get_all("Content-Length") or ())
        if len(lengths) > 1:  # which one frames the body? (a way to smuggle a request past a proxy)
            raise APIError(400, f"the Content-Length headers disagree: {', '.join(sorted(lengths))}")
        length = next(iter(lengths), None)
        if length is None:
            raise APIError(411, "a Content-Length header is required")
        size = whole_number(length)
        if size is None:
            raise APIError(400, f"bad Content-Length {length!r}")
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}",
                           code="request_too_large")
        return size

    def _drop_unread_body(self) -> None:
        """Read and drop a body no endpoint read (a 401, 404 or 405 answers before reading it), so the
        connection can serve its next request. A body framed otherwise than by one Content-Length within the
        limit, or one that does not arrive within the request timeout, is left: the connection closes."""
        if self.close_connection or "Transfer-Encoding" in self.headers:
            return
        try:
            size = self._body_size()
            self._body_unread = len(self.rfile.read(size)) < size
        except (APIError, OSError):  # not a body to read (RequestTimeout is an APIError), or the client left
            pass

    def send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self.send_body(status, json.dumps(obj).encode(), "application/json", headers)

    def send_body(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self._send_headers(status, {"Content-Type": content_type, "Content-Length": str(len(data)), **(headers or {})})
        if self.command != "HEAD":  # the headers say what a GET would get; the body stays here
            self.wfile.write(data)

    def begin_stream(self, content_type: str, headers: dict | None = None) -> None:
        self._send_headers(200, {"Content-Type": content_type, "Cache-Control": "no-cache", **(headers or {}),
                                 "Transfer-Encoding": "chunked"})
        self._streaming = True

    def _send_headers(self, status: int, headers: dict[str, str]) -> None:
        if self._body_unread:
            self._drop_unread_body()
        if self.close_connection or self._body_unread:  # a body no endpoint read would be taken for the next request
            headers["Connection"] = "close"  # http.server closes the connection after it, too
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def note_cut_stream(self, error: APIError) -> None:
        """A stream the server ended early (shutdown, engine failure) went out as a 200: its log line
        says it was cut, and why, so it does not read as a success."""
        self._status = f"{self._status} cut-by-server ({error.status}: {error.message})"

    def write_chunk(self, data: bytes) -> None:
        """One HTTP chunk; a write to a vanished client raises BrokenPipe/ConnectionReset."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def send_event(self, obj: dict | str) -> None:
        """One Server-Sent Event: `data: <json>` and a blank line, in a chunk of its own."""
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.write_chunk(f"data: {data}\n\n".encode())

    def client_gone(self) -> bool:
        """Has the client closed its end? Readable with nothing to read means EOF."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True
