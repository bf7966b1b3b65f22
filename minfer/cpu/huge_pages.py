"""Weights in 2 MB pages: a decode step streams every weight once, and 4 KB pages slow the stream.

On 4 KB pages a 250 MB read crosses 64,000 page boundaries, each a TLB miss, and the CPU's prefetchers stop
at every one. In 2 MB pages it crosses 125. Measured on a 2-core Zen 4 VM: a sum over 256 MB read 24.8 GB/s
on 4 KB pages and 33.5 GB/s on 2 MB pages (8 alternating rounds), and GPT-2's bf16 lone-decode package
stepped in 6.7-8.1 ms against 8.1-10.6 (fastest steps of alternating runs; docs/performance.md).

Linux gives anonymous memory 2 MB pages ("transparent huge pages") everywhere when its setting is `always`,
and only where a program asks (madvise MADV_HUGEPAGE) when it is `madvise`, the usual default. So once the
weights are in memory, `in_huge_pages` asks for the whole 2 MB pages inside them and has them moved there at
once (MADV_COLLAPSE, Linux 6.1; on an older kernel the system's khugepaged moves them over the following
minutes). Nothing is done where the setting is `never`, off Linux, or for memory not anonymous (weights read
in place from a checkpoint's file). The pages a weight only partly fills stay as they are: no memory is added.
Moving takes time (Qwen3-0.6B's packages, 1.2 GB: 3.8 s), so an engine has it done on a thread of its own while
it starts serving (`in_huge_pages_soon`); the kernel keeps every read exact while a page moves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import threading
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("minfer")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman.h
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MERGE_GAP = 4096  # tensors closer than this (neighbours in one allocation, or malloc headers apart) count as one range


@cache
def _madvise():
    """libc's madvise, or None where huge pages cannot be asked for (not Linux, or the setting is `never`)."""
    try:
        if "[never]" in SETTING.read_text():
            return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def memory_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The (start, end) addresses of these CPU tensors' storages, sorted, with neighbours merged."""
    storages = [t.untyped_storage() for t in tensors
                if t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and t.numel()]
    spans = sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1] + MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def in_huge_pages(tensors: Iterable[torch.Tensor], what: str = "weights") -> int:
    """Move the whole 2 MB pages inside these tensors' memory into huge pages (see the module doc). Returns
    the bytes moved now (0 where nothing could be, or the kernel moves them later). Never raises."""
    madvise = _madvise()
    if madvise is None:
        return 0
    moved = asked = 0
    for start, end in memory_ranges(tensors):
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE  # whole pages only
        if last - first < HUGE_PAGE or madvise(first, last - first, MADV_HUGEPAGE) != 0:
            continue  # too small, or not memory that can take huge pages
        asked += last - first
        if _collapse(madvise, first, last - first):
            moved += last - first
    if asked:
        log.info("minfer: %s in 2 MB pages: %.0f MB%s", what, moved / 2**20,
                 "" if moved == asked else f"; {(asked - moved) / 2**20:.0f} MB could not move (read from a file?)")
    return moved


def _collapse(madvise, start: int, length: int, tries: int = 3) -> bool:
    """MADV_COLLAPSE, tried again where the kernel calls its failure transient (EAGAIN: a page was locked or
    moving, as the kernel's own page scanners do now and then)."""
    for _ in range(tries):
        if madvise(start, length, MADV_COLLAPSE) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            return False
    return False


def in_huge_pages_soon(tensors: Iterable[torch.Tensor], what: str = "weights") -> threading.Thread:
    """`in_huge_pages` on a thread of its own, started now: the caller goes on (serving) meanwhile."""
    thread = threading.Thread(target=in_huge_pages, args=(list(tensors), what), name="minfer-huge-pages", daemon=True)
    thread.start()
    return thread


def huge_page_tensor(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU tensor in fresh memory asked for in 2 MB pages before it is first touched: its pages are huge from
    the first write, which on a VM read faster than pages moved later (a sum: 44-52 GB/s against 26-30 on the
    Zen 4). Plain memory where huge pages cannot be asked for. What --roofline reads to find its floor."""
    nbytes = numel * dtype.itemsize
    if _madvise() is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype)
    # private and untouched (shared anonymous memory takes huge pages by another setting); the tensor keeps it alive
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=-start % HUGE_PAGE)
