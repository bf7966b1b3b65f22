"""Compile once, load after: a warm-up whose compiled graphs are kept in minfer's cache (artifacts.py) and
loaded by the next start whose key is the same, instead of compiled again.

`warm_up_saved(name, functions, parts, warm_up)`:
1. opens the cache; where it is off, not the user's own or not writable, everything compiles in memory
   (one log line);
2. takes the entry's lock: a second start at once waits for the first's compile, then loads it;
3. loads each function's graphs (PrecompiledFunction, precompiled.py); an unreadable entry is one log
   line, compiled afresh and replaced;
4. runs the warm-up: a call that a loaded graph accepts runs it, any other precompiles one more graph, with
   a line of progress each (a call after the warm-up goes to torch.compile, unsaved: precompiled.py);
5. where the warm-up may serve and compiled anything, saves every graph (a full disk: one log line).
While it runs, Inductor's own cache, where its C++ and Triton kernels are compiled to and loaded from, is
the cache's `inductor/` directory (Inductor's default is under /tmp, where another user may have made it).

An entry's key, and the check of the code its graphs traced, are cache_key.py's.
"""

from __future__ import annotations

import logging
import pickle
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .artifacts import CacheEntry, open_cache
from .cache_key import changed_sources, common_parts, traced_sources
from .inductor_templates import templates_compiled_once
from .precompiled import PrecompiledFunction

log = logging.getLogger("minfer")


@dataclass
class CompileRecord:
    """How a warm-up got its graphs, for the banner and /health: "loaded (warm, 1.2 s)" or
    "compiled (cold, 31.0 s)", and why nothing was saved where nothing was."""

    # "loaded": every graph from the cache; "compiled": at least one compiled in this process; "traced": torch.compile
    # traced (and lowered) again, and Inductor's cache (in minfer's) held every kernel (the whole forward, step.py)
    how: str
    seconds: float
    num_loaded: int = 0
    num_compiled: int = 0
    not_saved: str | None = None  # why the graphs compiled here were not saved (the cache off, a full disk)
    path: Path | None = None  # the entry

    def __str__(self) -> str:
        if self.how == "loaded":
            return f"loaded (warm, {self.seconds:.1f} s)"
        if self.how == "traced":
            return f"traced again, kernels loaded (warm, {self.seconds:.1f} s)"
        unsaved = f"; not cached: {self.not_saved}" if self.not_saved else ""
        return f"compiled (cold, {self.seconds:.1f} s{unsaved})"


def warm_up_saved(
    name: str, functions: list[PrecompiledFunction], parts: dict, warm_up: Callable[[], str | None],
    device: torch.device | str = "cpu",
) -> tuple[str | None, CompileRecord]:
    """Run `warm_up` (None when what it compiled may serve, else why not) with `functions`' graphs loaded
    from the cache entry named `name` and keyed by `parts`, and save what it compiled: (why not, or None;
    how the graphs were had)."""
    start = time.perf_counter()
    root, why_off = open_cache()
    if root is None:
        log.info("minfer: the compile cache is off (%s): compiling %s in memory", why_off, name)
        with templates_compiled_once():
            why_not = warm_up()
        return why_not, _record(functions, start, not_saved=why_off)
    entry = CacheEntry(root, name, {"name": name, **common_parts(device), **parts})
    with entry.locked() as unlocked, inductor_cache_in(root / "inductor"), _precompiling(functions), \
            templates_compiled_once():
        _load(entry, functions)
        # Only a warm-up that torch.compiles for itself (no functions: the whole forward) is told traced or not.
        graphs_before = inductor_graph_counts()
        kernels_before = None if functions else built_kernels(root / "inductor")  # a large cache takes ms to walk
        why_not = warm_up()
        not_saved = unlocked
        if why_not is None and unlocked is None and any(f.num_compiled for f in functions):
            not_saved = _save(entry, functions, time.perf_counter() - start)
        # torch.compile ran, found its graphs in Inductor's cache or lowered them again, and built no kernel:
        # the cache held every one. Graphs with frozen weights (--compile-model) bypass Inductor's graph cache.
        reused, missed = (now - before for now, before in zip(inductor_graph_counts(), graphs_before))
        traced = not functions and reused and not missed and built_kernels(root / "inductor") == kernels_before
    record = _record(functions, start, not_saved, entry.path)
    if traced:
        record.how = "traced"
    return why_not, record


def _load(entry: CacheEntry, functions: list[PrecompiledFunction]) -> None:
    try:
        data = entry.read()
        if data is None:
            return
        saved = pickle.loads(data)
        changed = changed_sources(saved["sources"])
        if changed:  # the code a graph traced was edited since: compiled afresh, then replaced
            log.info("minfer: the code %s traced changed (%s): compiling afresh", entry.path.name, ", ".join(changed))
            return
        trust_vector_isas(saved.get("vector_isas"))
        for function in functions:
            if function.what in saved["graphs"]:
                function.load(saved["graphs"][function.what])
    except Exception as e:  # truncated, corrupt, from another build: compiled afresh, then replaced
        log.warning("minfer: the compile cache's %s is unreadable, compiling afresh: %s: %s",
                    entry.path.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def _save(entry: CacheEntry, functions: list[PrecompiledFunction], seconds: float) -> str | None:
    """Write every function's graphs; None, or why they were not written."""
    try:
        graphs = {f.what: f.serialized() for f in functions}
        sources = traced_sources([g for f in functions for g in f.graphs])
        data = pickle.dumps({"graphs": graphs, "sources": sources, "vector_isas": vector_isas()})
        entry.write(data, {"graphs": {f.what: len(f.graphs) for f in functions}, "compiled_in_s": round(seconds, 1)})
    except Exception as e:  # a full or read-only disk, a graph torch cannot serialize: served from memory
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("minfer: the compiled graphs were not saved to %s: %s", entry.path, why)
        return why
    log.info("minfer: saved the compiled graphs to %s", entry.path)
    return None


def vector_isas() -> list[str]:
    """The vector instruction sets Inductor found its C++ compiler builds for and this CPU loads."""
    from torch._inductor import cpu_vec_isa

    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def trust_vector_isas(recorded: list[str] | None) -> None:
    """Inductor compiles and loads a probe for each vector instruction set the CPU's flags claim, once a
    process: 1.5-2 s of a warm start. Where the start that compiled an entry found every one that the flags
    claim good (the key holds the flags), they are taken as good without that probe."""
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64"):
        return  # Inductor told what to do, or a CPU whose sets are found otherwise
    flags = cpu_vec_isa.x86_isa_checker()
    claimed = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if set(str(isa).split()) <= set(flags)]
    if recorded and recorded == claimed:
        config.cpp.vec_isa_ok = True


def _record(functions, start: float, not_saved: str | None = None, path: Path | None = None) -> CompileRecord:
    loaded, compiled = sum(f.num_loaded for f in functions), sum(f.num_compiled for f in functions)
    failed = [f.not_saved for f in functions if f.not_saved]  # the precompile failed: torch.compile serves
    how = "loaded" if loaded and not compiled and not failed else "compiled"
    not_saved = not_saved or next(iter(failed), None)
    return CompileRecord(how, time.perf_counter() - start, loaded, compiled, not_saved, path)


@contextmanager
def _precompiling(functions: list[PrecompiledFunction]) -> Iterator[None]:
    """While the warm-up runs, a call no graph accepts precompiles one, to be saved (precompiled.py)."""
    for function in functions:
        function.precompiling = True
    try:
        yield
    finally:
        for function in functions:
            function.precompiling = False


def inductor_graph_counts() -> tuple[int, int]:
    """Graphs Inductor's graph cache has served or let by (hits and bypasses), and its misses, so far in this
    process."""
    from torch._dynamo.utils import counters

    seen = counters["inductor"]
    return seen["fxgraph_cache_hit"] + seen["fxgraph_cache_bypass"], seen["fxgraph_cache_miss"]


def built_kernels(directory: Path) -> int:
    """How many compiled kernel libraries Inductor's cache in `directory` holds."""
    return sum(1 for _ in directory.rglob("*.so")) if directory.is_dir() else 0


@contextmanager
def inductor_cache_in(directory: Path) -> Iterator[None]:
    """Inductor's on-disk caches in `directory` while the body compiles and loads (torch's own switch, which
    also empties Inductor's in-memory caches on the way in and out)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with temporary_cache_dir(str(directory)):
        yield
