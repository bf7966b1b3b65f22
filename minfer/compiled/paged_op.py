"""Paged attention inside a compiled step: one opaque op, or plain torch traced in.

A compiled step (step.py) traces the whole model forward, but an attention backend's Python (per-step
metadata, its own compiled kernel) is not for Inductor to trace. So in a compiled step the metadata's
backend is an `OpaqueAttention`: its forward is one custom op, `minfer::paged_attention`, and the step's
batch reaches the op's body through a per-thread slot that `compiled_step(batch)` fills, as vLLM's forward
context does. One exception: in the whole-forward graph (--compile-model), a lone sequence's decode is
plain torch, traced in and fused there, where the backend offers it (`lone_decode_in_graph`,
attention.py): at batch 1 the op's Python cost more than the attention itself.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..attention.paged import PagedBatch

_step = threading.local()


class OpaqueAttention(AttentionBackend):
    """The backend a compiled step's graph sees: the real one (`backend`) behind one opaque op."""

    def __init__(self, backend: AttentionBackend, caches_are_inputs: bool = False):
        self.backend = backend
        self.name = backend.name
        self.caches_are_inputs = caches_are_inputs  # each layer's cache an input of the graph (packaged.py)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.shape[0] == 1 and self.backend.lone_decode_in_graph:  # traced into the graph
            return self.backend.traced_lone_decode(q, k, v, kv_cache, meta, scale, self.caches_are_inputs)
        return torch.ops.minfer.paged_attention(q, k, v, kv_cache, scale)  # (N, H, D)

    def behind(self, paged: PagedBatch) -> PagedBatch:
        """The step's batch as its graph sees it: the same, but for the backend its metadata names."""
        return replace(paged, attention=replace(paged.attention, backend=self))


@contextmanager
def compiled_step(paged: PagedBatch):
    """While a compiled step runs: the batch its attention op reads, and the dispatcher's state at the step."""
    _step.paged = paged
    _step.dispatch = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    try:
        yield
    finally:
        _step.paged = None


@torch.library.custom_op("minfer::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    # It writes kv_cache, which the op does not declare: declared, the compiler may copy the whole cache
    # to keep it functional. Nothing else in a step's graph reads the cache, so nothing can be reordered.
    paged = _step.paged
    # An op's body runs with most dispatch keys switched off, and the graph's tensors were made so. The
    # backend's own compiled kernel guards on them and would compile once more per shape: so it runs in
    # the step's dispatch state, on the engine's own view of this layer's cache (the same memory).
    with torch._C._ForceDispatchKeyGuard(*_step.dispatch):
        kv = paged.kv_cache.kv  # (num_layers, ...)
        layer = (kv_cache.data_ptr() - kv.data_ptr()) // (kv.stride(0) * kv.element_size())
        own = kv[layer] if 0 <= layer < kv.shape[0] else kv_cache
        if own.data_ptr() != kv_cache.data_ptr() or own.shape != kv_cache.shape:
            own = kv_cache  # not one layer of the engine's cache (a model of its own making): as given
        return paged.attention.backend.forward(q, k, v, own, paged.attention, scale)


@_paged_attention_op.register_fake
def _(q, k, v, kv_cache, scale):
    return torch.empty_like(q)  # (N, H, D)
