"""The CPU's attention backend: paged attention made fast on a CPU, chosen from what the CPU has.

`CPUTiledBackend` is torch_sdpa.py's backend with two CPU paths: decode context is read
through a `ContextReader`, and prefill chunks attend with `causal_attention_by_matmuls`.
The engine picks it for a model on the CPU (selector.py). `python bench.py --profile` splits an engine step
into KV write, context read, attention, linears, LM head, sampling and host time, so
running it with and without a path shows what the path is worth. (Paths 1-3, the packed
linears, live in cpu/packing.py.)

4. Tiled context reads (`ContextReader`). Pure torch cannot attend through a block
   table directly: a sequence's keys and values must first be gathered into a
   contiguous tensor. Gathering a whole batch moves the bytes three times (read,
   write, read back from DRAM); gathering a few sequences at a time keeps each tile
   in cache, so attention reads it from there. The cache stores a slot's key next to
   its value, so one gather of whole rows reads both. The tile is sized from the CPU's
   cache (`tile_bytes`). CPU sdpa in bf16 with one query per sequence is slower than
   in fp32, so bf16 tiles are upcast to fp32 while they are in cache. (Values could be
   read in place, `F.embedding_bag` with the softmax as per-sample weights, but exact
   scores still need the keys gathered and upcast; in the engine that was no faster.)
5. Prefill attention by matmuls (`causal_attention_by_matmuls`). With many queries, CPU sdpa
   (its flash-attention kernel) runs well below what plain batched matmuls reach on the
   same tensors, the more so the longer the chunk. Two matmuls and a softmax in fp32, a
   block of query rows at a time, compute the same attention: each block's scores stay
   within a tile (`tile_bytes`), and keys after a block's last query are never read.
   Measure it with `bench.py --profile` on long prompts ("attention" in prefill steps).
   On a CPU with AMX it is the other way round (`prefill_by_flash_attention`): sdpa's
   flash kernel runs its bf16 blocks on AMX tiles, and in bf16 it attends the cache's own
   dtype, so nothing is upcast (docs/performance.md).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..attention.torch_sdpa import DecodeGroup, TorchBackend
from ..step_parts import part
from .features import cpu_has_amx


@lru_cache(maxsize=None)
def cache_bytes(level: int) -> int | None:
    """Size of this CPU's level-`level` data/unified cache as Linux reports it (per instance), or None."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    for index in range(8):
        try:
            with open(f"{root}/index{index}/level") as f:
                if int(f.read()) != level:
                    continue
            with open(f"{root}/index{index}/type") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(f"{root}/index{index}/size") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            return None
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return None


MAX_TILE_BYTES = 8 << 20  # a quarter of a 32 MiB L3: no single core's share of a cache is larger


def tile_bytes() -> int:
    """How many bytes of gathered keys + values one attention tile may hold: a quarter of the
    last-level cache, so the tile is still in cache when attention reads it (4 MiB if unknown).
    Capped: a VM may report its whole host's cache (a 480 MiB "L3" was seen), which no tile fits."""
    llc = cache_bytes(3) or cache_bytes(2)
    return min(max(llc // 4, 1 << 20), MAX_TILE_BYTES) if llc else 4 << 20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the CPU paths attend in: fp32 (bf16 is upcast; CPU sdpa with one query per sequence is slower
    in bf16 than in fp32), or float64 for a float64 model (a reference precision)."""
    return torch.promote_types(dtype, torch.float32)


def prefill_by_flash_attention(dtype: torch.dtype) -> bool:
    """Whether prefill chunks attend with torch's sdpa (its CPU flash-attention kernel) rather than by
    matmuls (path 5). On an AMX host sdpa won at every chunk measured (16 to 512 queries, 512 to 1024
    positions, GPT-2's and Qwen3's heads): 3-8x in bf16, whose blocks it multiplies on AMX tiles, and
    1.1-2.3x in fp32. Elsewhere (Zen 3, Zen 4) the matmuls won. float64 keeps the matmuls."""
    return cpu_has_amx() and dtype in (torch.bfloat16, torch.float32)


def causal_attention_by_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk (path 5): q (H, T, D) holds the queries of the last T of the
    L positions whose keys and values k, v (Hkv, L, D) hold. Returns (H, T, D) in q's dtype.

    Computed in fp32 (bf16 inputs are upcast; float64 stays float64), like the decode path's tiles. With
    grouped-query attention (Hkv < H) the G query heads that share a key/value head are stacked into one
    matrix of G x rows. Memory: a block's scores, at most a tile or 32 query rows against the context."""
    H, T, D = q.shape
    Hkv, L, _ = k.shape
    G = H // Hkv  # query heads per key/value head
    compute = compute_dtype(q.dtype)
    k, v = k.to(compute), v.to(compute)
    q = q.view(Hkv, G, T, D)  # head h reads key/value head h // G
    out = torch.empty(H, T, D, dtype=q.dtype, device=q.device)
    out_groups = out.view(Hkv, G, T, D)
    # query rows per block: a block's scores fill about a tile
    rows = max(32, tile_bytes() // (H * L * k.element_size()))
    for first in range(0, T, rows):
        last = min(T, first + rows)  # this block's queries: rows first..last-1 of the chunk
        keys = L - T + last  # the block's last query sits at position keys - 1: later keys are all masked
        future = torch.ones(last - first, keys, dtype=torch.bool, device=q.device).triu_(L - T + first + 1)
        bias = torch.zeros(future.shape, dtype=compute, device=q.device).masked_fill_(future, float("-inf"))
        queries = (q[:, :, first:last].to(compute) * scale).reshape(Hkv, G * (last - first), D)  # (Hkv, G x rows, D)
        scores = torch.bmm(queries, k[:, :keys].transpose(1, 2)).add_(bias.repeat(G, 1))  # (Hkv, G x rows, keys)
        y = torch.bmm(torch.softmax(scores, dim=-1), v[:, :keys])  # (Hkv, G x rows, D)
        out_groups[:, :, first:last] = y.view(Hkv, G, last - first, D)
    return out


class ContextReader:
    """Gathers context from the paged cache into buffers it reuses, a tile at a time (path 4).

    A fresh tensor of tens of MB comes from mmap and pays a page fault per 4 KB on first
    touch: several times the copy itself. These buffers are allocated once, grown rarely,
    and bounded by a tile (or by one sequence's full context), never by the batch.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._tile_bytes = tile_bytes()

    dtype_read = staticmethod(compute_dtype)  # tiles are upcast while in cache: cache dtype -> dtype read

    def seqs_per_tile(self, kv_cache: torch.Tensor, context_len: int) -> int:
        """How many sequences of this (padded) context length one tile holds."""
        as_read = self.dtype_read(kv_cache.dtype).itemsize  # (see read)
        key_and_value_bytes = math.prod(kv_cache.shape[1:]) * as_read * context_len
        return max(1, self._tile_bytes // key_and_value_bytes)

    @property
    def largest_buffer_bytes(self) -> int:
        return max((b.numel() * b.element_size() for b in self._buffers.values()), default=0)

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """kv_cache (num_slots, 2, Hkv, D), slots (...) -> kv_cache[slots] (..., 2, Hkv, D) in dtype_read
        (in the cache's dtype if not `upcast`). One gather reads keys and values: a slot's key and value
        sit side by side, one contiguous row per slot. The result lives in a reused buffer: it is valid
        until the next read."""
        row, n = math.prod(kv_cache.shape[1:]), slots.numel()
        out = self.buffer("kv", kv_cache.dtype, kv_cache.device, n * row).view(n, row)
        torch.index_select(kv_cache.view(-1, row), 0, slots.view(-1), out=out)
        wide = self.dtype_read(out.dtype)
        if upcast and out.dtype != wide:  # upcast while still in cache
            out = self.buffer("kv32", wide, kv_cache.device, n * row).view(n, row).copy_(out)
        return out.view(*slots.shape, *kv_cache.shape[1:])

    def buffer(self, name: str, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A reused buffer of `numel` elements: valid until the next call with this name."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            # Grow by half again, not by the few bytes asked for: decode contexts grow a token a step.
            grown = 3 * buf.numel() // 2 if buf is not None and buf.dtype == dtype else 0
            buf = self._buffers[name] = torch.empty(max(numel, grown), dtype=dtype, device=device)
        return buf[:numel]


class CPUTiledBackend(TorchBackend):
    """The plain backend (torch_sdpa.py) with the CPU's paths: tiled context reads (4) and prefill
    attention by matmuls (5), or by sdpa where that is faster. One per engine: its reader's buffers
    are reused across layers and steps."""

    name = "cpu_tiled"

    def __init__(self, device: torch.device | str, dtype: torch.dtype):
        super().__init__(device, dtype)
        self.reader = ContextReader()
        self.flash_prefill = prefill_by_flash_attention(dtype)

    def decode_attention(self, q, kv_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
        """q (S, H, D): one query per sequence against its whole context, read `seqs_per_tile` sequences at a
        time into the reader's buffers (upcast to fp32 there). Returns (S, H, D)."""
        S, L = group.slots.shape
        step = self.reader.seqs_per_tile(kv_cache, L)
        queries = q.unsqueeze(2).to(self.reader.dtype_read(kv_cache.dtype))  # (S, H, 1, D)
        gqa = q.shape[1] != kv_cache.shape[2]
        out = torch.empty_like(q).unsqueeze(2)  # (S, H, 1, D)
        for i in range(0, S, step):
            with part("context read"):
                # (T, L, 2, Hkv, D), valid until the next read
                kv = self.reader.read(kv_cache, group.slots[i : i + step])
                ks, vs = kv.permute(2, 0, 3, 1, 4)  # 2 x (T, Hkv, L, D)
            mask = None if group.mask is None else group.mask[i : i + step]  # (T, 1, 1, L)
            with part("attention"):
                y = F.scaled_dot_product_attention(
                    queries[i : i + step], ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa
                )
                out[i : i + step] = y  # (T, H, 1, D), back in q's dtype
        return out.squeeze(2)

    def chunk_context(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's context (2, Hkv, L, D): upcast for the matmuls, in the cache's dtype for sdpa."""
        kv = self.reader.read(kv_cache, slots, upcast=not self.flash_prefill)  # (L, 2, Hkv, D)
        return kv.permute(1, 2, 0, 3)

    def prefill_attention(self, q, k, v, mask, scale: float) -> torch.Tensor:
        if self.flash_prefill:
            return super().prefill_attention(q, k, v, mask, scale)  # sdpa, in k's dtype
        return causal_attention_by_matmuls(q, k, v, scale)  # the mask is implied: the last T of L, causal
