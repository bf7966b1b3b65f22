"""The live view: the page served at `/` and the `/engine/events` stream that feeds it.

The page is one self-contained HTML document (minfer/server/static/live.html, with live.css and
the scripts charts.js, blockmap.js and live.js inlined into it here): no CDN, no framework, no
build step.

`/engine/events` is Server-Sent Events. Each message's data is a JSON list of engine
events (engine_events.py): the first message starts with a full snapshot, then come
the step and update events in order. A viewer gets at most MESSAGES_PER_SECOND
messages; the steps of a busier engine arrive batched in one message. A viewer too
slow to keep up falls behind the feed's ring, loses the old events and restarts
from a fresh snapshot, so it never holds the engine back.
"""

from __future__ import annotations

import functools
import time
from importlib import resources
from typing import Callable

from .engine_events import EngineFeed, FeedClosed

MESSAGES_PER_SECOND = 20
KEEPALIVE_SECONDS = 15.0  # an idle stream sends a comment now and then, so proxies keep it open
CLIENT_CHECK_SECONDS = 0.5  # while idle, check this often whether the viewer left


STATIC_FILES = ["live.css", "charts.js", "blockmap.js", "live.js"]  # each replaces its /* name */ in live.html


@functools.cache
def page() -> bytes:
    static = resources.files("minfer.server") / "static"
    html = (static / "live.html").read_text(encoding="utf-8")
    for name in STATIC_FILES:
        html = html.replace(f"/* {name} */", (static / name).read_text(encoding="utf-8"))
    return html.encode()


def stream_events(feed: EngineFeed, write: Callable[[bytes], None], end: Callable[[], None],
                  client_gone: Callable[[], bool]) -> None:
    """Write the feed to one viewer as SSE until it leaves (a write raises) or the engine stops, then `end` the
    stream while still subscribed: the server's stop waits for its viewers to leave, then the process exits."""
    interval = 1.0 / MESSAGES_PER_SECOND
    try:
        viewer = feed.subscribe()
    except FeedClosed:  # the engine stopped before this viewer came: an empty stream, ended
        return end()
    with viewer:
        last_write = time.monotonic()
        while True:
            try:
                events = viewer.read_json(timeout=CLIENT_CHECK_SECONDS)
            except FeedClosed:
                return end()
            now = time.monotonic()
            if events:
                write(b"data: " + events + b"\n\n")
                last_write = now
                time.sleep(interval)  # what the engine does meanwhile comes in the next message
            elif client_gone():
                return end()
            elif now - last_write > KEEPALIVE_SECONDS:
                write(b": keep-alive\n\n")
                last_write = now
