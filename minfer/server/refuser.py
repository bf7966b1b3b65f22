"""The refuser: one thread that answers every connection beyond the server's cap (connections.py).

Past --max-connections, a thread per connection is what we must not spend, so
the accept thread hands each extra socket to this one thread, which answers
them all: a quick JSON 503 with Retry-After, except `GET /health`, answered as
usual so that probes see a live server at the cap.
"""

from __future__ import annotations

import json
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable

from .api_errors import APIError

REFUSE_READ_SECONDS = 1.0  # how long the refuser waits for a refused connection's request (to spot /health)
REFUSE_LINGER_SECONDS = 1.0  # after answering, read and drop what the client still sends, so close() sends no RST
MAX_REFUSING = 256  # connections the refuser holds at once; beyond that, new ones are closed at once


class Refuser:
    """One thread answers every connection beyond the cap: 503, or the health status for GET /health.

    It reads all of them at once without blocking (one selector), so a refused
    client that sends nothing delays no one; it answers once the headers are in,
    or after REFUSE_READ_SECONDS, then drains what the client still sends (a
    close with unread data would reset the connection and lose the answer)."""

    def __init__(self, health: Callable[[], tuple[int, dict]], max_connections: int):
        self.health = health
        self.max_connections = max_connections
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.held = 0  # refused connections not yet closed
        self._thread: threading.Thread | None = None

    def refuse(self, sock: socket.socket) -> None:
        """Called by the accept thread only."""
        with self._lock:
            full = self.held >= MAX_REFUSING
            self.held += not full
        if full:
            sock.close()
            return
        self.inbox.put(sock)
        if self._thread is None:  # started on the first refusal: a server below its cap never has it
            self._thread = threading.Thread(target=self._run, name="minfer-refuser", daemon=True)
            self._thread.start()

    def response(self, head: bytes) -> bytes:
        line = head.split(b"\r\n", 1)[0].split()
        if len(line) == 3 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/health":
            status, body = self.health()
            extra = b""
        else:
            status = 503
            message = f"the server is at its limit of {self.max_connections} connections; retry shortly"
            body = APIError(503, message, code="too_many_connections").body()
            extra = b"Retry-After: 1\r\n"
        data = json.dumps(body).encode()
        reason = b"OK" if status == 200 else b"Service Unavailable"
        return (
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s"
            b"Connection: close\r\n\r\n%s" % (status, reason, len(data), extra, data)
        )

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        while True:
            while not self.inbox.empty() or not selector.get_map():  # nothing held: sleep until one comes
                sock = self.inbox.get()
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ, _Refused(time.monotonic() + REFUSE_READ_SECONDS))
            for key, _ in selector.select(timeout=0.05):
                try:
                    data = key.fileobj.recv(8192)
                except OSError:
                    data = b""
                key.data.receive(data)
            now = time.monotonic()
            for key in list(selector.get_map().values()):
                refused: _Refused = key.data
                if not refused.answered and (refused.eof or now >= refused.due or refused.has_head()):
                    refused.answered = True
                    try:
                        key.fileobj.send(self.response(refused.head))  # small, into an empty buffer: no wait
                        key.fileobj.shutdown(socket.SHUT_WR)
                        refused.due = now + REFUSE_LINGER_SECONDS
                    except OSError:
                        refused.eof = True
                if refused.answered and (refused.eof or now >= refused.due):
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    with self._lock:
                        self.held -= 1


class _Refused:
    """What the refuser knows of one refused connection."""

    def __init__(self, due: float):
        self.due = due  # answer by then; once answered, close by then
        self.head = b""  # what has arrived of the request, up to its headers
        self.eof = False
        self.answered = False

    def receive(self, data: bytes) -> None:
        if not data:
            self.eof = True
        elif not self.answered and len(self.head) < 8192:
            self.head += data

    def has_head(self) -> bool:
        return b"\r\n\r\n" in self.head or len(self.head) >= 8192
