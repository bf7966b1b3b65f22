"""Names for the parts of an engine step, so `bench.py --profile` can say where the time goes.

The engine marks each part it runs (`with part("context read"): ...`). Normally that
costs one flag check; while bench.py profiles, each part becomes a torch.profiler range.
"""

from __future__ import annotations

from contextlib import nullcontext

from torch.profiler import record_function

# The labelled parts, in step order. Everything else the forward runs is linears (matmuls)
# or the small ops around them (layer norms, GELU, residual adds, embeddings).
PARTS = (
    "host: schedule",
    "host: prepare",
    "KV write",
    "context read",
    "attention",
    "LM head",
    "sampling",
    "host: bookkeeping",
)

_enabled = False
_NONE = nullcontext()


def part(name: str):
    """A context manager marking one part of a step (a no-op unless profiling)."""
    return record_function(name) if _enabled else _NONE


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on
