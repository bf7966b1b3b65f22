"""CPU fast paths: what makes minfer fast on a CPU, each chosen from what the CPU has.

model.py is plain GPT-2 with nn.Linear; nothing in it knows about CPUs. When a model
is loaded onto the CPU, `optimize_for_cpu(model)` swaps in faster equivalents, and
paged attention reads decode context through a `ContextReader`. Each path below
says why it exists and how to measure it: `python bench.py --profile` splits an
engine step into KV write, context read, attention, linears, LM head, sampling and
host time, so running it with and without a path shows what the path is worth.
Figures go stale and differ between CPUs; bench.py prints them for the machine at hand.

1. Prepacked linears (`PackedLinear`). Eager `F.linear` hands the weight to
   MKL/oneDNN in its plain (out, in) layout every call, and their kernels for a
   decode step's few rows read it well below memory speed. oneDNN can reorder a
   weight once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
   the path torch.compile's CPU backend uses); the same matmul then runs faster
   at every row count, one row (memory-bound) or hundreds (compute-bound). The
   packed copy replaces the plain weight, so memory does not grow.
2. The LM head, prepacked the same way (`LMHead`). Its weight is tied to the token
   embedding, which the input lookup still needs, so this is a second copy of the
   (V, C) matrix: worth it, the LM head is a third of GPT-2 small's weight bytes.
   In fp32 a one-row step uses a third copy, sliced per thread (see LMHead).
3. bf16, by hardware. With AVX512-BF16 or AMX, bf16 matmuls run natively, several
   times faster than fp32, and get packed like fp32. Without them (e.g. AVX2-only
   CPUs) torch emulates bf16 matmuls, several times slower than fp32: there
   `Bf16StorageLinear` keeps bf16 only as storage and computes batches in fp32.
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
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kv_cache import cdiv

PACKING_BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; good at 1 to 512 too


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 run bf16 matmuls in hardware; without them torch emulates bf16, slower than fp32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


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


def tile_bytes() -> int:
    """How many bytes of gathered keys + values one attention tile may hold: a quarter of the
    last-level cache, so the tile is still in cache when attention reads it (4 MiB if unknown)."""
    llc = cache_bytes(3) or cache_bytes(2)
    return max(llc // 4, 1 << 20) if llc else 4 << 20


@lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can prepack `dtype` weights: fp32 anywhere oneDNN runs, bf16
    only with native bf16 (oneDNN would emulate it elsewhere, or refuse). A trial pack decides."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACKING_BATCH_HINT)
    except (RuntimeError, AttributeError):
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight reordered into oneDNN's blocked layout (an opaque tensor, same numel)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT)


def padded_rows(n: int) -> int:
    """n rounded up to one of a few row counts: exact up to 16, then four steps per doubling (at most
    25% padding). oneDNN compiles and caches a kernel for every input shape it sees, about a MB each
    on GPT-2's matrices: a server's ever-changing token counts would grow memory by GBs without this."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 3)
    return cdiv(n, step) * step


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight from pack_weight: x (..., in) -> (..., out)."""
    rows = x.reshape(-1, x.shape[-1])  # (M, in)
    M = rows.shape[0]
    padding = padded_rows(M) - M
    if padding:
        rows = F.pad(rows, (0, 0, 0, padding))  # zero rows, dropped below
    y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")  # (M', out)
    return y[:M].view(*x.shape[:-1], y.shape[-1])


class PackedLinear(nn.Module):
    """nn.Linear whose weight is held in oneDNN's blocked layout (see the module docstring, path 1)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(pack_weight(linear.weight), requires_grad=False)  # replaces the plain one
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


class Bf16StorageLinear(nn.Linear):
    """bf16 weights on a CPU without native bf16 (path 3): a few rows are memory-bound and stay bf16
    (half the bytes to read); more rows would be emulated bf16 matmuls, so they compute in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.numel() < 4 * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def optimize_for_cpu(model: nn.Module) -> None:
    """Swap every nn.Linear of `model` for its fast CPU equivalent, in place; `model.lm_head`, if it
    has one, becomes an LMHead. Calling it again changes nothing."""
    dtype = next(model.parameters()).dtype
    if packing_available(dtype):
        make = PackedLinear
    elif dtype == torch.bfloat16:
        make = _as_bf16_storage
    else:
        return
    if make is PackedLinear and type(getattr(model, "lm_head", None)) is nn.Linear:
        model.lm_head = LMHead(model.lm_head.weight)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear and not (parent is model and name == "lm_head"):
                setattr(parent, name, make(child))


class LMHead(nn.Module):
    """The LM head on a CPU (path 2): a prepacked copy of the (V, C) matrix for batches. In fp32 a
    single row also has a copy sliced per thread: (P, C, V/P), one contiguous slice per core run as a
    batched matmul. oneDNN's one-row GEMV reads the matrix at about half that speed, and a batch-1
    decode step spends a third of its bytes here. One more copy of the matrix buys it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.vocab_size, self.in_features = weight.shape
        # Plain attributes, not parameters: these are copies, and the model's weights stay as they were.
        self.packed = pack_weight(weight)
        threads = torch.get_num_threads()
        self.sliced = None
        if weight.dtype == torch.float32 and threads > 1:
            V, C = weight.shape
            width = cdiv(V, threads)
            padded = torch.zeros(threads * width, C, dtype=weight.dtype)
            padded[:V] = weight
            self.sliced = padded.t().reshape(C, threads, width).permute(1, 0, 2).contiguous()  # (P, C, V/P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., V)
        if self.sliced is None or x.numel() != self.sliced.shape[1]:  # one row only
            return packed_linear(x, self.packed)
        P, C, width = self.sliced.shape
        logits = torch.bmm(x.reshape(1, 1, C).expand(P, 1, C), self.sliced)  # (P, 1, V/P): a slice per core
        return logits.transpose(0, 1).reshape(*x.shape[:-1], P * width)[..., : self.vocab_size]


def _as_bf16_storage(linear: nn.Linear) -> Bf16StorageLinear:
    linear.__class__ = Bf16StorageLinear  # same parameters, a different forward
    return linear


def causal_attention_by_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk (path 5): q (H, T, D) holds the queries of the last T of the
    L positions whose keys and values k, v (Hkv, L, D) hold. Returns (H, T, D) in q's dtype.

    Computed in fp32 whatever the dtype (bf16 inputs are upcast), like the decode path's tiles. With
    grouped-query attention (Hkv < H) the G query heads that share a key/value head are stacked into one
    matrix of G x rows. Memory: a block's scores, at most a tile or 32 query rows against the context."""
    H, T, D = q.shape
    Hkv, L, _ = k.shape
    G = H // Hkv  # query heads per key/value head
    k, v = k.float(), v.float()
    q = q.view(Hkv, G, T, D)  # head h reads key/value head h // G
    out = torch.empty(H, T, D, dtype=q.dtype, device=q.device)
    out_groups = out.view(Hkv, G, T, D)
    rows = max(32, tile_bytes() // (H * L * 4))  # query rows per block: a block's fp32 scores fill about a tile
    for first in range(0, T, rows):
        last = min(T, first + rows)  # this block's queries: rows first..last-1 of the chunk
        keys = L - T + last  # the block's last query sits at position keys - 1: later keys are all masked
        future = torch.ones(last - first, keys, dtype=torch.bool, device=q.device).triu_(L - T + first + 1)
        bias = torch.zeros(future.shape, device=q.device).masked_fill_(future, float("-inf"))  # (rows, keys)
        queries = (q[:, :, first:last].float() * scale).reshape(Hkv, G * (last - first), D)  # (Hkv, G x rows, D)
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

    def seqs_per_tile(self, kv_cache: torch.Tensor, context_len: int) -> int | None:
        """How many sequences of this (padded) context length one tile holds; None: all of them
        (on a GPU, where the gathered batch is read back from fast memory anyway)."""
        if kv_cache.device.type != "cpu":
            return None
        key_and_value_bytes = math.prod(kv_cache.shape[1:]) * 4 * context_len  # as read: in fp32 (see read)
        return max(1, self._tile_bytes // key_and_value_bytes)

    @staticmethod
    def dtype_read(kv_cache: torch.Tensor) -> torch.dtype:
        """The dtype `read` returns: fp32 on a CPU (whose sdpa is slower in bf16 with one query), else the cache's."""
        return torch.float32 if kv_cache.device.type == "cpu" else kv_cache.dtype

    @property
    def largest_buffer_bytes(self) -> int:
        return max((b.numel() * b.element_size() for b in self._buffers.values()), default=0)

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """kv_cache (num_slots, 2, Hkv, D), slots (...) -> kv_cache[slots] (..., 2, Hkv, D) in dtype_read.
        One gather reads keys and values: a slot's key and value sit side by side, one contiguous row
        per slot. The result lives in a reused buffer: it is valid until the next read."""
        row, n = math.prod(kv_cache.shape[1:]), slots.numel()
        out = self._buffer("kv", kv_cache.dtype, kv_cache.device, n * row).view(n, row)
        torch.index_select(kv_cache.view(-1, row), 0, slots.view(-1), out=out)
        wanted = self.dtype_read(kv_cache)
        if out.dtype != wanted:  # upcast while still in cache
            out = self._buffer("kv32", wanted, kv_cache.device, n * row).view(n, row).copy_(out)
        return out.view(*slots.shape, *kv_cache.shape[1:])

    def _buffer(self, name: str, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            # Grow by half again, not by the few bytes asked for: decode contexts grow a token a step.
            grown = 3 * buf.numel() // 2 if buf is not None and buf.dtype == dtype else 0
            buf = self._buffers[name] = torch.empty(max(numel, grown), dtype=dtype, device=device)
        return buf[:numel]
