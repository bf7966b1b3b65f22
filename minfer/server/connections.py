"""The HTTP server's connections, held to their limits (ConnectionLimits, connection_limits.py).

ThreadingHTTPServer gives each connection a thread and, left alone, waits on it forever: a client that
sends half a request, keeps an idle connection, or stops reading its stream holds a thread for good.
Here each read has a deadline (408, or a quiet close for an idle keep-alive connection), each write a
timeout (the stream ends, the request's blocks are freed), and beyond the connection cap one small
refuser thread answers 503 (refuser.py). Each socket gets a 32 KiB send buffer: token streams need
little, and a small buffer lets the write timeout notice a client that stopped reading early."""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from .api_errors import APIError
from .connection_limits import ConnectionLimits
from .refuser import Refuser

SEND_BUFFER_BYTES = 32 * 1024


class RequestTimeout(APIError):
    """The client did not send its whole request in time."""

    def __init__(self, seconds: float):
        super().__init__(408, f"the request did not arrive within {seconds:g} s", code="request_timeout")


class IdleTimeout(Exception):
    """A kept-alive connection sent no new request in time: close it without a word."""


class WriteTimeout(ConnectionError):
    """The client stopped reading: a write stayed blocked past the write timeout."""


# ---- counters, for /metrics ----------------------------------------------------------


class ConnectionStats:
    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self.open = 0
        self.refused = 0
        self.timeouts = {"request": 0, "idle": 0, "write": 0}

    def try_open(self) -> bool:
        with self._lock:
            if self.open >= self.max_connections:
                self.refused += 1
                return False
            self.open += 1
            return True

    def on_close(self) -> None:
        with self._lock:
            self.open -= 1

    def on_timeout(self, kind: str) -> None:
        with self._lock:
            self.timeouts[kind] += 1


# ---- the socket's two sides, with time limits ----------------------------------------


class RequestReader(io.RawIOBase):
    """The socket's read side (under the handler's buffered rfile), with a deadline per request."""

    def __init__(self, sock: socket.socket, limits: ConnectionLimits, stats: ConnectionStats):
        self.sock = sock
        self.limits = limits
        self.stats = stats
        self.deadline = 0.0  # the current wait ends then
        self.idle = False  # waiting for a kept-alive connection's next request, under the keep-alive timeout
        self.started = False  # has any byte of the current request arrived?

    def readable(self) -> bool:
        return True

    def next_request(self, first: bool) -> None:
        """A new connection's first request is due within the request timeout; a later one may idle first."""
        self.started, self.idle = False, not first
        timeout = self.limits.request_timeout if first else self.limits.keepalive_timeout
        self.deadline = time.monotonic() + timeout

    def readinto(self, buf) -> int:
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError()
            self.sock.settimeout(left)
            n = self.sock.recv_into(buf)
        except TimeoutError:
            self.stats.on_timeout("idle" if self.idle else "request")
            raise IdleTimeout() if self.idle else RequestTimeout(self.limits.request_timeout) from None
        if n and self.idle:  # the next request began: all of it is due within the request timeout
            self.idle, self.deadline = False, time.monotonic() + self.limits.request_timeout
        self.started = self.started or n > 0
        return n


class TimedWriter(io.BufferedIOBase):
    """The socket's write side (the handler's wfile): each write must complete within the write timeout."""

    def __init__(self, sock: socket.socket, write_timeout: float, stats: ConnectionStats):
        self.sock = sock
        self.write_timeout = write_timeout
        self.stats = stats

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sock.settimeout(self.write_timeout)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            self.stats.on_timeout("write")
            raise WriteTimeout(f"the client read nothing for {self.write_timeout:g} s") from None
        return len(data)


# ---- the handler and server sides ----------------------------------------------------


class TimedHandler(BaseHTTPRequestHandler):
    """A request handler whose reads and writes obey the server's ConnectionLimits."""

    server: "CappedHTTPServer"
    # http.server takes a request line it cannot parse for HTTP/0.9, whose replies have no status line or
    # headers: the client would read a bare JSON body. Every client here speaks HTTP/1.x.
    default_request_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self.reader = RequestReader(self.connection, self.server.limits, self.server.stats)
        self.rfile = io.BufferedReader(self.reader)
        self.wfile = TimedWriter(self.connection, self.server.limits.write_timeout, self.server.stats)
        self.requests_read = 0

    def handle_one_request(self) -> None:
        self.reader.next_request(first=self.requests_read == 0)
        self.requests_read += 1
        # http.server sets these while parsing; a 408 may come before that
        self.command, self.requestline, self.request_version = None, "", self.default_request_version
        try:
            super().handle_one_request()
        except (IdleTimeout, OSError):  # idle past keep-alive, or the client vanished or stopped reading
            self.close_connection = True
        except RequestTimeout as e:  # in the request line or headers (the body's is the handler's to answer)
            self.close_connection = True
            if self.reader.started:  # a request began: tell the client why it gets no answer
                with contextlib.suppress(OSError):
                    self.send_error(408, e.message)


class CappedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `limits.max_connections` handler threads; the rest are refused.

    `health()` returns (status, JSON body) for GET /health; the refuser answers it even at the cap."""

    daemon_threads = True  # an idle keep-alive connection must not hold up exit

    def __init__(self, address, handler, limits: ConnectionLimits, health: Callable[[], tuple[int, dict]]):
        self.limits = limits
        self.stats = ConnectionStats(limits.max_connections)
        self.refuser = Refuser(health, limits.max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if self.stats.try_open():
            super().process_request(request, client_address)  # starts the handler thread
        else:
            self.refuser.refuse(request)  # it closes the socket itself

    def shutdown_request(self, request) -> None:
        """The end of every opened connection: its handler thread's, or that of a thread that failed to start."""
        self.stats.on_close()
        super().shutdown_request(request)
