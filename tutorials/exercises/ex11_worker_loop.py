"""Exercise 11: the engine's worker loop, which sleeps on an Event while idle.

Write `run`, the body of SchedulerManager's worker thread (the target of its "minfer-engine" thread).
Then run

    python tutorials/11_scheduler_manager.py --exercise

and the stage's clients stream through your loop: its asserts (an idle worker uses no CPU, every
client gets Accepted, one delta per step and Done, a released request frees its blocks, shutdown sends
503s and refuses later requests) grade it. minfer's own is SchedulerManager._run in
minfer/server/manager.py.

What you work with, on `self` (a SchedulerManager), all already written:
- self._wake: the threading.Event that submit() and release() set after adding to the inbox;
- self._drain_inbox(): adds submitted requests and carries out discards; returns whether there was
  any; self._drain_inbox(refuse=message) refuses what is left with a 503 instead;
- self._step(): one scheduler step, its deltas and Done events sent to the requests' queues (if it fails,
  the requests in flight get an Error and the loop goes on);
- self.scheduler: the OnlineScheduler (has_unfinished(), stats(), close());
- self._stats: the stats snapshot handlers read (assign a fresh scheduler.stats() to it; minfer's own loop
  calls self._read_stats(), which keeps the last snapshot if reading fails);
- self._stopping, self._dead, self._lock: shutdown() sets _stopping (under _lock);
- self.events (the live view's feed): if self.events.active, call
  self._recorder.between_steps(self.events, queues_changed) after draining (minfer's own runs it through
  self._guarded(work, *args): a failure there fails the requests in flight, as a step's would); and
  self.events.close() at the end;
- self._fail_all(status, message): an Error event to every request still in the scheduler.
"""

from __future__ import annotations


def run(self) -> None:
    """Loop until shutdown, then wind down.

    The loop, forever:
    1. clear the wake event *before* draining the inbox: a submit that lands after the drain sets it
       again, and is never missed;
    2. drain the inbox; if self._stopping, leave the loop;
    3. if the scheduler has nothing unfinished: publish self._stats, then sleep on the wake event (no
       polling: an idle worker must use no CPU), and go round again;
    4. else run one step (self._step()) and publish self._stats.
    An exception anywhere in the loop ends it too (log it).

    Winding down, always (try/finally): under self._lock set self._dead = not self._stopping (a crash,
    not a shutdown) and then self._stopping = True, so submit() refuses from now on; refuse what is still
    in the inbox with a 503 message ("the engine has stopped" after a crash, "the server is shutting
    down" otherwise), fail every request still running with 503 and that message, publish the stats a
    last time, close the event feed and the scheduler.
    """
    raise NotImplementedError
