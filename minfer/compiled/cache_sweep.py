"""The compile cache's upkeep: an entry no start has used for MAX_UNUSED_DAYS is removed.

Every change to what an entry depends on (minfer or torch upgraded, the compiled code edited, another
checkpoint) names a new entry (cache_key.py), and the old one would stay on disk for good: a whole-forward
package set is 1.5 GB for Qwen3-0.6B in bf16. Each start that takes an entry's lock marks the entry used (the
lock file's modification time, artifacts.py); once a process, the first time it opens the cache, every
entry whose mark is older than MAX_UNUSED_DAYS goes, with its record, its package folders and any temporary
files a killed start left. Two minfer versions sharing the cache keep their own entries as long as each runs
now and then. An entry whose lock another start holds is left alone.

Inductor's own directory (`inductor/`, the kernels' sources and libraries) is not swept: its files are read
without a mark, so nothing says which are still in use.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

log = logging.getLogger("minfer")

MAX_UNUSED_DAYS = 30
_ENTRY = re.compile(r"^\.?(?P<stem>[a-z][a-z-]*-[0-9a-f]{32})\.")  # `name-key.`, or a temporary `.name-key.`
_swept: set[Path] = set()  # the directories this process has swept


def sweep_once(entries: Path) -> None:
    """`sweep(entries)` the first time this process opens the cache there; never raises."""
    if entries in _swept:
        return
    _swept.add(entries)
    try:
        removed = sweep(entries)
    except OSError as e:
        log.info("minfer: the compile cache's upkeep failed (%s)", e.strerror or e)
        return
    if removed:
        log.info("minfer: removed %d compile cache %s unused for %d days from %s", len(removed),
                 "entry" if len(removed) == 1 else "entries", MAX_UNUSED_DAYS, entries)


def sweep(entries: Path, max_unused_s: float = MAX_UNUSED_DAYS * 86400.0, now: float | None = None) -> list[str]:
    """Remove every entry in `entries` last used more than `max_unused_s` ago: its files and folders. Returns the
    entries' names (`name-key`) removed."""
    now = time.time() if now is None else now
    paths: dict[str, list[Path]] = defaultdict(list)
    for path in entries.iterdir():
        match = _ENTRY.match(path.name)
        if match:
            paths[match["stem"]].append(path)
    removed = []
    for stem, found in sorted(paths.items()):
        lock = entries / f"{stem}.lock"
        last_used = _last_touched([lock] if lock in found else found)  # without a lock: its newest file's time
        if last_used is not None and now - last_used > max_unused_s and _remove(lock, found):
            removed.append(stem)
    return removed


def _last_touched(paths: list[Path]) -> float | None:
    """The newest modification time of those paths still there (a start may be renaming one)."""
    times = []
    for path in paths:
        try:
            times.append(path.lstat().st_mtime)
        except FileNotFoundError:
            pass
    return max(times, default=None)


def _remove(lock: Path, paths: list[Path]) -> bool:
    """Remove the entry's paths under its lock, the lock file last; False where another start holds it."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or a filesystem without locks: left alone
        os.close(fd)
        return False
    try:
        for path in paths:
            if path == lock:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return True
