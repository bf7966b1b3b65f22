"""minfer's compile cache on disk: where it lives, the key that names an entry, and reading and writing an
entry safely. What goes in an entry, and when, is saved_graphs.py's business; this file moves bytes.

- Where: MINFER_CACHE, else $XDG_CACHE_HOME/minfer, else ~/.cache/minfer: beside the Hugging Face cache's
  own default (~/.cache/huggingface, which follows XDG the same way). Not beside HF_HOME when that is set:
  it often names a disk a team shares, and no one's compiled code should be loaded from there.
  MINFER_CACHE=off compiles in memory.
- Whose: the directory is created 0700, and refused (compile in memory, one log line) where it is not the
  user's own or others may write it. An entry is pickled code and the source of native kernels; loading
  one runs it. Inductor's own directory, where compiles outside a warm-up go, is checked alike
  (`check_inductors_own`).
- The key: a hash of every part an entry depends on (cache_key.py lists them). A part that changes
  names a different entry, which starts empty: it is compiled afresh, never loaded wrong.
- Writing: to a temporary file in the same directory, fsynced, then renamed over the entry, so a reader
  sees a whole entry or none. A lock file per key (flock) is held from the first read to the last write,
  so two starts at once compile once: the second waits, then loads what the first wrote.
- Upkeep: taking the lock marks the entry used; an entry unused for 30 days is removed (cache_sweep.py).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import settings
from .cache_sweep import sweep_once

log = logging.getLogger("minfer")

OFF = "off"  # MINFER_CACHE=off: compile in memory
LOCK_WAIT_S = 600.0  # longest a start waits for another's compile of the same entry before compiling alone


def cache_root() -> Path:
    """Where the cache lives, whether or not it exists yet (see the module's docstring)."""
    chosen = settings.CACHE.get()
    if chosen is not None:
        return Path(chosen).expanduser()
    return Path(settings.XDG_CACHE_HOME.get("~/.cache")).expanduser() / "minfer"


def open_cache() -> tuple[Path | None, str | None]:
    """The cache's directory, created if missing and checked: (the directory, None), or (None, why it is
    not used) where it is switched off, cannot be made, or is not safe to load code from."""
    check_inductors_own()
    if settings.CACHE.get() == OFF:
        return None, f"{settings.CACHE.name}={OFF}"
    root = cache_root()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        why_unsafe = unsafe(root) or unsafe_above(root)
        if why_unsafe:
            return None, f"{root} {why_unsafe}"
        for sub in ("entries", "inductor"):
            (root / sub).mkdir(mode=0o700, exist_ok=True)
            why_unsafe = unsafe(root / sub)
            if why_unsafe:
                return None, f"{root / sub} {why_unsafe}"
            # 0700 even where it was made otherwise: Inductor makes its folders inside by the umask (0775 for
            # some), so only a closed folder above them keeps others from writing the code loaded there.
            (root / sub).chmod(0o700)
    except OSError as e:
        return None, f"{root} cannot be used: {e.strerror or e}"
    if not os.access(root, os.W_OK | os.X_OK):
        return None, f"{root} is not writable"
    sweep_once(root / "entries")
    return root, None


def check_inductors_own() -> None:
    """Inductor's own cache directory is where every compile outside a warm-up writes and loads its kernels (a
    recompile mid-serve; every compile with this cache off or refused): /tmp/torchinductor_<user> by default,
    which another user may have made first. Where it is not safe (`unsafe`), this process compiles into a new
    directory of its own instead, with one log line, and removes it at exit."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    directory = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        why_unsafe = unsafe(directory) or unsafe_above(directory)
    except OSError as e:
        why_unsafe = f"cannot be used ({e.strerror or e})"
    if why_unsafe:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = private = tempfile.mkdtemp(prefix="minfer-inductor-")  # 0700
        atexit.register(shutil.rmtree, private, ignore_errors=True)  # this process's alone: gone with it
        log.warning("minfer: Inductor's cache %s %s: this process compiles into %s", directory, why_unsafe, private)


def unsafe(path: Path) -> str | None:
    """Why code must not be loaded from `path` (a directory or a file), or None: it must be this user's
    own, and writable by no one else."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def unsafe_above(path: Path) -> str | None:
    """Why a folder above `path` would let another user swap `path` for a folder of theirs, or None: each must
    be this user's or root's, and writable by no one else unless sticky (as /tmp is: there others cannot rename
    what is not theirs)."""
    for folder in path.resolve().parents:
        info = folder.stat()
        if info.st_uid not in (0, os.getuid()):
            return f"lies in {folder}, which belongs to another user (uid {info.st_uid})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            return f"lies in {folder}, which other users can write (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def key_of(parts: dict) -> str:
    """The hash that names an entry: every part, in a canonical order."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class CacheEntry:
    """One entry of the cache: `<root>/entries/<name>-<key>.bin`, its lock, and a JSON record beside it
    of the parts its key was made from (what `ls` shows a person clearing the cache)."""

    def __init__(self, root: Path, name: str, parts: dict):
        self.root, self.parts = root, parts
        stem = root / "entries" / f"{name}-{key_of(parts)}"
        self.path, self.record_path, self.lock_path = (stem.with_suffix(s) for s in (".bin", ".json", ".lock"))

    @contextmanager
    def locked(self, wait_s: float = LOCK_WAIT_S) -> Iterator[str | None]:
        """Holds the entry's lock while the body reads, compiles and writes; yields None, or where the lock could
        not be had within `wait_s` (or at all) why not: the body then compiles without saving."""
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            why = f"its lock {self.lock_path} cannot be opened ({e.strerror or e})"
            log.info("minfer: the compile cache entry %s is not used: %s", self.path.name, why)
            yield why
            return
        try:
            yield self._acquire(fd, wait_s)
        finally:
            os.close(fd)  # releases the lock

    def _acquire(self, fd: int, wait_s: float) -> str | None:
        """None once the lock is held, else why it is not."""
        deadline, waited = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                with contextlib.suppress(OSError):  # the entry is in use: the upkeep keeps it (cache_sweep.py)
                    os.utime(fd)
                return None
            except BlockingIOError:
                if not waited:
                    log.info("minfer: another start is compiling %s; waiting for it", self.path.name)
                    waited = True
                if time.monotonic() > deadline:
                    log.warning("minfer: waited %.0f s for another start's compile: compiling alone", wait_s)
                    return f"another start held its lock past {wait_s:.0f} s"
                time.sleep(0.1)
            except OSError as e:  # a filesystem without locks
                log.info("minfer: the compile cache cannot lock %s (%s)", self.lock_path, e.strerror or e)
                return f"its lock {self.lock_path} cannot be taken ({e.strerror or e})"

    def read(self) -> bytes | None:
        """The entry's bytes; None where there is none yet. Raises OSError for a file that is there but
        unreadable or not safe to load (not the user's own, writable by others)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise OSError(f"{self.path} is not safe to load: another user's, or writable by others")
            return f.read()

    def write(self, data: bytes, record: dict) -> None:
        """Replace the entry with `data`, atomically, and its record beside it. Raises OSError (a full or
        read-only disk): the caller logs it and serves what it compiled."""
        write_atomically(self.path, data)
        write_atomically(self.record_path, json.dumps({**record, "key_parts": self.parts}, indent=1).encode())


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or is as it was: written beside it, then renamed over it. Raises OSError."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
