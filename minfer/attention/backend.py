"""The attention-backend interface: what ModelRunner describes a step with (StepLayout), and what every
backend implements (AttentionBackend) and builds (AttentionMetadata).

A backend has two jobs:
- `build_metadata(layout)`, once per step: ModelRunner.prepare describes the step in a backend-neutral
  `StepLayout` (each sequence's rows, context length and block table; each new token's slot), and the
  backend turns it into the metadata it wants: padded slot grids for the eager backends, a block mask
  for FlexAttention, fixed-address buffers for a CUDA graph. The metadata names the backend that built it.
- `forward(q, k, v, kv_cache, meta, scale)`, once per layer: write K/V, attend.
Every other capability a backend may have is declared on the Protocol with its default. Backends:
torch_sdpa.py (the plain one, any device), cpu/tiled_attention.py and compiled/attention.py (the
CPU's), compiled/flex.py (FlexAttention over the block tables: a GPU's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

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
    all_decode: bool = False  # every row is a decode, one per sequence, in order (a compiled step's graph serves it)


class AttentionBackend(Protocol):
    """What an attention backend implements (torch_sdpa.TorchBackend is the plain one). Every capability a
    backend may have is declared here with its default; a backend subclasses this and overrides what it has."""

    name: str  # how the config names it (attention_backend="cpu_tiled")
    captures_in_graphs = False  # builds its metadata inside a CUDA graph (graph_metadata): compiled/flex.py
    traces_lone_decode = False  # has traced_lone_decode, for --compile-model's graph: compiled/attention.py
    lone_decode_in_graph = False  # a compiled whole-forward graph traces its lone decode in (set by the assembly)
    compiles_per_shape = False  # compiles per kind of step: the engine warms each up, then seals (compiled/warm_up.py)
    warm_up_seconds: float | None = None  # what warm_up's compile took, where it compiled
    compile_record = None  # how warm_up had its kernels, loaded or compiled (compiled/saved_graphs.py); None: none

    def build_metadata(self, layout: StepLayout) -> AttentionMetadata:
        """Once per step, before the forward: the step's layout -> this backend's metadata."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # (N, H, D)
        k: torch.Tensor,  # (N, Hkv, D)
        v: torch.Tensor,  # (N, Hkv, D)
        kv_cache: torch.Tensor,  # one layer's keys and values, as new_cache lays them out
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (N, H, D)
        """Once per layer: store k, v in their slots (meta.slot_mapping), then attend."""
        ...

    def new_cache(self, config, num_blocks: int, block_size: int, device, dtype) -> KVCache:
        """The KV cache this backend reads: by default, a slot's key next to its value (kv_cache.py)."""
        return KVCache(config, num_blocks, block_size, device, dtype)

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
        """Before the engine starts: compile and check what needs it. None when the backend may serve,
        else a sentence saying why not (the assembly then falls back to the plain backend)."""
        return None

    def graph_metadata(self, slot_mapping, tables, context_lens, block_size: int, null_block: int) -> AttentionMetadata:
        """With captures_in_graphs: an all-decode step's metadata from static buffers, by device ops alone."""
        raise NotImplementedError(f"the {self.name} backend builds no metadata inside a CUDA graph")

    def traced_lone_decode(
        self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, cache_is_input: bool = False
    ) -> torch.Tensor:
        """With lone_decode_in_graph: a lone sequence's decode as plain torch, for a graph to trace.
        `cache_is_input`: the layer's cache is an input of the graph, not a view of the whole cache."""
        raise NotImplementedError(f"the {self.name} backend has no traced lone decode")
