"""The engine event feed: what the worker did each step, for the live view and online traces.

Two halves, one per side of the thread boundary:

- `EventRecorder` runs on the engine worker thread only. It reads the scheduler
  through its public API and describes, as plain JSON-ready dicts, a full
  `snapshot` (every block's state, the queues, each running request's block
  table), each `step` (chunks run, queues, blocks that changed state,
  preemptions, finishes) and each `update` (requests added or discarded between
  steps). It finds the blocks that changed without touching the allocator's hot
  paths: a block changes state only when it joins a running request's block
  table (allocated, or shared from the prefix cache) or when that request leaves
  the running set (finished, preempted, discarded) and drops its table.
- `EngineFeed` is the thread-safe mailbox between the worker and any number of
  viewers (HTTP handler threads). The worker appends to a bounded ring and never
  waits for a viewer; a viewer that falls further behind than the ring reaches
  loses the old events and is handed a fresh snapshot instead. With no viewer
  the worker does nothing but check `feed.active`.

No prompt or output text goes into the feed: request ids, lengths and block ids only.

Field lists: a request is `[id, prompt_tokens, computed_tokens, generated_tokens,
max_tokens, preemptions, cached_tokens]` (REQUEST_FIELDS); a chunk is `[id, start,
num_tokens]`; a finished request is `[id, ttft_ms, tpot_ms, generated_tokens,
finish_reason]`; `tables` maps a running request id to `[offset, block ids]`: its
block table from index `offset` on (offset 0 replaces what the viewer had). In a
snapshot, `blocks` is a string with one letter per block: f(ree), u(sed), c(ached);
in steps and updates it maps the block ids that changed to "free", "used" or "cached".
`shared` lists the used blocks held by several sequences (a prefix-cache hit, or the
prompt of a request with n > 1): all of them in a snapshot, those that changed in a
step or update. Choice i > 0 of such a request is named "id.i" (feed_id).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import deque
from typing import Callable

REQUEST_FIELDS = [
    "id",
    "prompt_tokens",
    "computed_tokens",
    "generated_tokens",
    "max_tokens",
    "preemptions",
    "cached_tokens",
]
STATE_LETTER = {"free": "f", "used": "u", "cached": "c"}


class EventRecorder:
    """Describes the scheduler's state and steps. Worker thread only."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.tables: dict[str, list[int]] = {}  # running request id -> the block ids viewers know it holds
        self.last_step = scheduler.num_steps
        self.wall_offset = time.time() - time.perf_counter()  # step times are perf_counter values

    def snapshot(self) -> dict:
        s = self.scheduler
        allocator = s.allocator
        self.tables = {feed_id(seq): list(seq.block_table) for seq in s.running}
        self.last_step = s.num_steps
        return {
            "type": "snapshot",
            "time": time.time(),
            "step": s.num_steps,
            "num_blocks": allocator.num_blocks,
            "block_size": s.block_size,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "request_fields": REQUEST_FIELDS,
            "blocks": "".join([STATE_LETTER[state] for state in allocator.block_states()]),
            "tables": {feed_id(seq): [0, list(seq.block_table)] for seq in s.running},
            "shared": allocator.shared_block_ids(),
            "running": [describe(seq) for seq in s.running],
            "waiting": [describe(seq) for seq in s.waiting],
        }

    def step(self, num_sampled: int, finished: list) -> dict:
        """After scheduler.step() and pop_response() of `finished` (RequestOutputs): a step event,
        or an update if the call scheduled nothing."""
        s = self.scheduler
        if s.num_steps == self.last_step:
            return self.update(finished)
        self.last_step = s.num_steps
        info = s.last_step
        event = {
            "type": "step",
            "step": s.num_steps,
            "start": info.start + self.wall_offset,
            "end": info.end + self.wall_offset,
            "num_seqs": info.num_seqs,
            "num_prefill_tokens": info.num_prefill_tokens,
            "num_decode_tokens": info.num_decode_tokens,
            "num_sampled": num_sampled,
            "num_draft_tokens": info.num_draft_tokens,  # speculative decoding: proposals verified ...
            "num_accepted_tokens": info.num_accepted_tokens,  # ... and accepted this step
            "kv_blocks_used": info.kv_blocks_used,
            "chunks": [[feed_id(c.seq), c.start, c.num_tokens] for c in s.last_chunks],
        }
        return self._changes(event, finished)

    def update(self, finished: list = ()) -> dict:
        """Requests were added or discarded (or a step failed) outside a step."""
        return self._changes({"type": "update", "time": time.time(), "step": self.scheduler.num_steps}, finished)

    def between_steps(self, feed: "EngineFeed", queues_changed: bool) -> None:
        """Publish a snapshot when a viewer waits for one (it holds the queue changes too), else an
        update when requests came or went."""
        if feed.snapshot_wanted:
            feed.publish(self.snapshot())
        elif queues_changed:
            feed.publish(self.update())

    def _changes(self, event: dict, finished) -> dict:
        s = self.scheduler
        allocator = s.allocator
        running = {feed_id(seq): seq for seq in s.running}
        waiting_ids = {feed_id(seq) for seq in s.waiting}
        changed: set[int] = set()
        left = [rid for rid in self.tables if rid not in running]
        for rid in left:  # its blocks were freed (shared ones may still be in use by others)
            changed.update(self.tables.pop(rid))
        tables = {}
        for rid, seq in running.items():
            known = self.tables.setdefault(rid, [])
            table = seq.block_table
            # Tables only grow while a request runs, but for copy-on-write: a fork's last block, shared
            # with its siblings until it writes there, becomes its own copy.
            start = len(known)
            if known and len(table) >= start and table[start - 1] != known[-1]:
                start -= 1
            if len(table) > start:
                new = table[start:]
                tables[rid] = [start, new]
                changed.update(known[start:])  # the block given up: now shared by fewer, or by none
                changed.update(new)
                known[start:] = new
        finished_ids = {finished_id(out) for out in finished}
        event.update(
            {
                "running": [describe(seq) for seq in s.running],
                "waiting": [describe(seq) for seq in s.waiting],
                "tables": tables,
                "blocks": {b: allocator.block_state(b) for b in sorted(changed)},
                "shared": [b for b in sorted(changed) if allocator.is_shared(b)],  # of those, held by several
                "preempted": [rid for rid in left if rid in waiting_ids],
                "finished": [finished_entry(out) for out in finished],
                "discarded": [rid for rid in left if rid not in waiting_ids and rid not in finished_ids],
            }
        )
        return event


def feed_id(seq) -> str:
    """A sequence's name in the feed: its request's id, and for choice i > 0 of a request with n > 1,
    "id.i" (choice 0, which runs the prompt, is the request's own id)."""
    return seq.request_id if seq.index == 0 else f"{seq.request_id}.{seq.index}"


def finished_id(out) -> str:
    return out.request_id if out.index == 0 else f"{out.request_id}.{out.index}"


def describe(seq) -> list:
    """A request as REQUEST_FIELDS: lengths only, never text."""
    return [
        feed_id(seq),
        seq.num_prompt_tokens,
        seq.num_computed_tokens,
        seq.num_output_tokens,
        seq.params.max_tokens,
        seq.num_preemptions,
        seq.num_cached_tokens,
    ]


def finished_entry(out) -> list:
    ttft = tpot = None
    if out.first_token_time is not None:
        ttft = round((out.first_token_time - out.arrival_time) * 1e3, 3)
        if len(out.token_ids) > 1 and out.finish_time is not None:
            tpot = round((out.finish_time - out.first_token_time) * 1e3 / (len(out.token_ids) - 1), 3)
    return [finished_id(out), ttft, tpot, len(out.token_ids), out.finish_reason]


class Published:
    """An event in the feed, and its JSON once a viewer has needed it: encoded once, however many viewers
    read it (fifty viewers each encoding every event took a third of the engine's speed)."""

    __slots__ = ("event", "_json")

    def __init__(self, event: dict):
        self.event = event
        self._json: bytes | None = None

    def json(self) -> bytes:
        if self._json is None:  # two viewers may both encode it at once: the same bytes either way
            self._json = json.dumps(self.event, separators=(",", ":")).encode()
        return self._json


class FeedClosed(Exception):
    """The engine stopped: no more events will come."""


class EngineFeed:
    """A bounded ring of events from the worker, read by any number of viewers.

    Events are deltas, so a viewer starts from a snapshot and replays what follows it. With no
    viewer the worker publishes nothing, so the ring is emptied when the last viewer leaves."""

    def __init__(self, wake: Callable[[], None] = lambda: None, capacity: int = 256):
        self.active = False  # some viewer is connected: the worker's one check per step
        self.snapshot_wanted = False  # a viewer waits for a snapshot: the worker publishes one soon
        self.capacity = capacity
        self._wake = wake  # wakes an idle worker so that it publishes the snapshot
        self._cond = threading.Condition()
        self._events: deque[Published] = deque(maxlen=capacity)  # the oldest fall off: bounded memory
        self._first = 0  # sequence number of _events[0]
        self._viewers = 0
        self._closed = False

    # ---- the worker ----

    def publish(self, event: dict) -> None:
        """Append an event; never waits on a viewer (the lock guards a few deque operations only)."""
        with self._cond:
            if len(self._events) == self.capacity:
                self._first += 1
            self._events.append(Published(event))
            if event["type"] == "snapshot":
                self.snapshot_wanted = False
            self._cond.notify_all()

    def close(self) -> None:
        """The engine stopped: every viewer's read raises FeedClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- viewers ----

    def subscribe(self) -> "Viewer":
        with self._cond:
            if self._closed:
                raise FeedClosed()
            self._viewers += 1
            self.active = True
        return Viewer(self)

    def unsubscribe(self) -> None:
        with self._cond:
            self._viewers -= 1
            self.active = self._viewers > 0
            if not self.active:  # the worker stops publishing: what is here would go stale
                self._first += len(self._events)
                self._events.clear()
            self._cond.notify_all()  # wakes wait_viewers_gone

    def wait_viewers_gone(self, timeout: float) -> bool:
        """After close(): wait until every viewer has left (written the end of its stream)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._viewers == 0, timeout)

    def read(self, viewer: "Viewer", timeout: float) -> list[Published]:
        """The events the viewer has not seen, from a snapshot on if it has none (new, or fell behind
        the ring); [] if none came within `timeout` seconds. Raises FeedClosed once the engine stopped."""
        with self._cond:
            end = self._first + len(self._events)
            if viewer.cursor is None or viewer.cursor < self._first:
                viewer.cursor = self._latest_snapshot(end)
                if viewer.cursor is None:
                    self.snapshot_wanted = True
                    self._wake()
            if viewer.cursor is None or viewer.cursor == end:
                if not self._closed:  # a viewer that was busy writing missed close()'s notify: no wait then
                    self._cond.wait(timeout)
                if self._closed:
                    raise FeedClosed()
                return []
            events = list(itertools.islice(self._events, viewer.cursor - self._first, None))
            viewer.cursor = end
            return events

    def _latest_snapshot(self, end: int) -> int | None:
        for i in range(end - 1, self._first - 1, -1):
            if self._events[i - self._first].event["type"] == "snapshot":
                return i
        return None


class Viewer:
    """One reader's place in the feed. Use it as a context manager, so that it always unsubscribes."""

    def __init__(self, feed: EngineFeed):
        self.feed = feed
        self.cursor: int | None = None  # the next event to read; None until it has a snapshot

    def read(self, timeout: float) -> list[dict]:
        """The unseen events (EngineFeed.read)."""
        return [p.event for p in self.feed.read(self, timeout)]

    def read_json(self, timeout: float) -> bytes:
        """The unseen events as one JSON list; b"" if none."""
        published = self.feed.read(self, timeout)
        return b"[" + b",".join(p.json() for p in published) + b"]" if published else b""

    def __enter__(self) -> "Viewer":
        return self

    def __exit__(self, *exc) -> None:
        self.feed.unsubscribe()
