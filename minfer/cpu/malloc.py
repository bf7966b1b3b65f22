"""Give freed memory back to the OS while a quantized model loads or a compiled package builds (glibc only).

glibc serves a large allocation with its own mmap, unmapped when freed, but only above its mmap
threshold; and each such free raises the threshold to the freed block's size (up to 32 MiB). After
the first few float weights are freed, later ones come from the heap, and a heap freed in the
middle is not returned. Quantizing while loading frees one float tensor per weight: Qwen3-0.6B's
int8 load peaked at 2.0 GB of RSS for 0.6 GB of weights, 0.87 GB with the threshold held at
128 KiB (measured, /usr/bin/time -v; with loader.read_alone). int4's repacking frees an int32
copy of each weight in the same way (2.6 GB -> 0.99 GB), and a compiled package's build its frozen, packed and
padded copies (Qwen3-0.6B bf16's first start: 8.5 GB -> 6.2, and 4.4 GB kept after -> 2.1). After loading,
the threshold is set to glibc's own ceiling (32 MiB), where a long-running process's dynamic threshold ends up
anyway, so steps keep reusing heap blocks instead of mapping fresh pages. Setting it stops glibc from adjusting
its trim threshold too, which would stay at 128 KiB: every step's freed temporaries at the heap's top went back to
the OS and were faulted in again on the next. So the trim threshold is set where glibc's dynamic rule puts it,
twice the mmap threshold (an int8 GPT-2, 64 requests: 1.6-2.1M page faults a run -> 1.2M, and ~10%
more tokens/s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from contextlib import contextmanager
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
WHILE_LOADING = 128 << 10  # glibc's initial threshold
AFTER_LOADING = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_AFTER_LOADING = 2 * AFTER_LOADING  # glibc's own rule when it adjusts the mmap threshold itself


@cache
def glibc_mallopt():
    """libc's mallopt, or None off glibc (musl, macOS: they manage this differently)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc.mallopt if hasattr(libc, "gnu_get_libc_version") else None


@contextmanager
def freed_memory_returned():
    """Inside: allocations above 128 KiB are mapped and unmapped on their own (no heap left behind)."""
    mallopt = glibc_mallopt()
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, WHILE_LOADING)
    try:
        yield
    finally:
        if mallopt is not None:
            mallopt(M_MMAP_THRESHOLD, AFTER_LOADING)
            mallopt(M_TRIM_THRESHOLD, TRIM_AFTER_LOADING)
