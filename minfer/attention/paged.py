"""Paged attention: what a model's attention layer calls, and what an attention backend implements.

One forward pass carries every token scheduled this step, flattened into N rows (no
padding, many sequences side by side). The linear layers treat the rows alike; attention
is the only per-sequence part. Each layer calls

    paged_attention(q, k, v, kv_cache, meta, scale)   # (N, H, D) -> (N, H, D)

which writes this step's keys and values into their cache slots and lets every row attend
over its own sequence's context, read through the sequence's block table. How is the
business of an *attention backend*, an object with two methods:

- `build_metadata(layout)`, once per step: ModelRunner.prepare describes the step in a
  backend-neutral `StepLayout` (each sequence's rows, context length and block table;
  each new token's slot), and the backend turns it into the metadata it wants: padded slot
  grids for the eager backends, a block mask for FlexAttention, fixed-address buffers for
  a CUDA graph. The metadata names the backend that built it.
- `forward(q, k, v, kv_cache, meta, scale)`, once per layer: write K/V, attend.

The engine picks one backend per model at load time (selector.py, from the device and the
config). Models only call `paged_attention`; they never know which backend runs.
Backends: torch_sdpa.py (any device: gather each sequence's context, then sdpa),
cpu_tiled.py (the CPU's: gathered a tile at a time, prefill chunks by matmuls), compiled.py
(the CPU's, decode read in place by a compiled kernel) and flex.py (FlexAttention over the
block tables: a GPU's).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .kv_cache import KVCache


@dataclass
class StepLayout:
    """One engine step as ModelRunner.prepare flattens it, for any backend: S sequences, N new tokens.
    Sequence i owns rows query_starts[i] .. + query_lens[i] of the flat batch: its tokens at positions
    context_lens[i] - query_lens[i] .. context_lens[i] - 1. Per-sequence facts are host lists: each
    backend turns what it needs into device tensors, once per step."""

    slot_mapping: torch.Tensor  # (N,) cache slot of every new token's key and value, on the device
    query_starts: list[int]  # (S,) first row of each sequence
    query_lens: list[int]  # (S,) its new tokens this step: 1 for a decode, more for a prompt chunk
    context_lens: list[int]  # (S,) its tokens once this step is done: cached context + new tokens
    block_tables: list[list[int]]  # (S,) its blocks, in order (at least cdiv(context_len, block_size))
    block_size: int
    null_block: int  # a block no sequence owns, kept zeroed: padded reads land there

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass
class AttentionMetadata:
    """What every backend's metadata holds; each backend subclasses it with what it needs."""

    slot_mapping: torch.Tensor  # (N,) cache slot for every new token's key/value
    backend: AttentionBackend  # the backend that built it, and that runs it


class AttentionBackend(Protocol):
    """What an attention backend implements (torch_sdpa.TorchBackend is the plain one)."""

    name: str  # how the config names it (attention_backend="cpu_tiled")

    def build_metadata(self, layout: StepLayout) -> AttentionMetadata:
        """Once per step, before the forward: the step's layout -> this backend's metadata."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # (N, H, D)
        k: torch.Tensor,  # (N, Hkv, D)
        v: torch.Tensor,  # (N, Hkv, D)
        kv_cache: torch.Tensor,  # (num_slots, 2, Hkv, D): one layer's keys and values
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (N, H, D)
        """Once per layer: store k, v in their slots (meta.slot_mapping), then attend."""
        ...


@dataclass
class PagedBatch:
    """What the model needs, beyond the token ids, to run one engine step (ModelRunner.prepare builds it)."""

    positions: torch.Tensor  # (N,) position of every token in its own sequence
    kv_cache: KVCache  # every layer's keys and values, in blocks
    attention: AttentionMetadata  # where each token's keys go and which context each sequence reads
    sample_rows: torch.Tensor  # (S,) rows the LM head sees: those that draw a token, then prompt rows scored


def paged_attention(
    q: torch.Tensor,  # (N, H, D)
    k: torch.Tensor,  # (N, Hkv, D): Hkv = H, or H / group size with grouped-query attention
    v: torch.Tensor,  # (N, Hkv, D)
    kv_cache: torch.Tensor,  # (num_slots, 2, Hkv, D) this layer's keys and values, a slot's key next to its value
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # (N, H, D)
    """Store this step's keys and values in the cache, then attend: each row over its own sequence's
    context (cached tokens and this step's, causally). The backend that built `meta` does the work."""
    if torch.compiler.is_compiling():  # inside a compiled step (engine/compiled_step.py)
        if q.shape[0] == 1 and getattr(meta.backend, "lone_decode_in_graph", False):
            return meta.backend.traced_lone_decode(q, k, v, kv_cache, meta, scale)  # traced: see below
        return torch.ops.minfer.paged_attention(q, k, v, kv_cache, scale)  # one opaque op: the backend's Python
    return meta.backend.forward(q, k, v, kv_cache, meta, scale)


# ---- paged attention inside a compiled step ----------------------------------------------------
# A compiled step (engine/compiled_step.py) traces the whole model forward, but a backend's Python
# (per-step metadata, its own compiled kernel) is not for Inductor to trace. So there attention is
# one opaque op, and the step's batch reaches it here, as vLLM's forward context does. One exception:
# in the whole-forward graph (--compile-model), a lone sequence's decode is plain torch, traced in and
# fused there, where the backend offers it (compiled.py, `lone_decode_in_graph`): at batch 1 the op's
# Python cost more than the attention itself.
_step = threading.local()


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
