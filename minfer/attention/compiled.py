"""The compiled attention backend: decode attention that reads the paged cache in place.

Eager torch must gather each sequence's keys and values out of the paged cache into a
buffer (and upcast bf16) before sdpa can read them, so the context crosses memory three
times. `paged_decode_attention` below says the same attention in plain torch, indexing the
cache through the slot table; torch.compile (Inductor: a C++ loop on a CPU) fuses the
gather, the upcast, the scores, the masked softmax and the weighted sum into one pass, and
the gathered context is never stored. The function is the lesson; the compiler does the fusion.

- Decode rows (one query per sequence) run here: they are bound by reading the context.
- Prefill chunks keep the eager CPU path (gather once, then two matmuls): a chunk of T
  queries does T x L work per context position read, so it is bound by compute, which
  matmuls do best.
- Compiled with dynamic=True, so batch size and context length never trigger a recompile
  while serving. Dynamo still guards on what else it sees: sizes of 1 (a lone sequence gets
  a kernel of its own, compiled by `warm_up`; `one_shape` pads a one-token context to 2),
  strides (q is made contiguous), and sizes that happen to be equal (duck sizing, switched
  off while `warm_up` compiles). `warm_up` compiles before the engine starts, on the first
  layer's cache and a later one's, and checks every result against the eager backend. If
  anything fails (no C++ compiler, a compile error, a mismatch, a compile slower than its
  time budget), the engine runs the eager backend instead and says why (engine/prepare.py).
- On a CPU `auto` compiles for a bf16/fp16 cache only: with fp32 the eager read, which has
  nothing to upcast, measured faster (selector.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch
import torch.fx.experimental._config as fx_config

from ..step_parts import part
from .cpu_tiled import CPUTiledBackend
from .paged import StepLayout
from .torch_sdpa import DecodeGroup

WARM_UP_BUDGET_S = 60.0  # longest the start-up compile may take before the engine gives up on it


def paged_decode_attention(
    q: torch.Tensor,  # (S, H, D): one query per sequence
    kv_cache: torch.Tensor,  # (num_slots, 2, Hkv, D): one layer's keys and values
    slots: torch.Tensor,  # (S, L): cache slot of each context position; padding reads a zeroed slot
    lens: torch.Tensor,  # (S,): each sequence's context length; positions past it are masked
    scale: float,
) -> torch.Tensor:  # (S, H, D)
    S, H, D = q.shape
    Hkv = kv_cache.shape[2]
    G = H // Hkv  # query heads per key/value head (grouped-query attention; 1 for GPT-2)
    kv = kv_cache[slots].float()  # (S, L, 2, Hkv, D): compiled, it is read in place, never stored
    keys, values = kv[:, :, 0], kv[:, :, 1]  # (S, L, Hkv, D)
    queries = q.float().view(S, 1, Hkv, G, D)  # a group of G query heads shares one key/value head
    scores = (queries * keys[:, :, :, None, :]).sum(-1) * scale  # (S, L, Hkv, G)
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < lens[:, None]  # (S, L)
    scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=1)  # over each sequence's context
    out = (weights[..., None] * values[:, :, :, None, :]).sum(1)  # (S, Hkv, G, D)
    return out.reshape(S, H, D).to(q.dtype)


def one_shape(group: DecodeGroup, null_slot: int) -> DecodeGroup:
    """Dynamic shapes still specialise sizes of 1, so a context of one token would compile a kernel
    of its own: it gets a padding column (the zeroed null slot, masked), which costs one cached read
    per sequence. (A lone sequence is not padded: a padding row would double a batch-1 step's
    attention; `warm_up` compiles that kernel too.) lens gets its own storage: as a view into the
    backend's (2, S) tensor its storage offset is S, which the kernel would guard on too."""
    slots, lens = group.slots, group.lens.clone()  # (S, L), (S,)
    if slots.shape[1] == 1:
        slots = torch.cat((slots, torch.full_like(slots, null_slot)), dim=1)  # (S, 2)
    return replace(group, slots=slots, lens=lens)


class CompiledBackend(CPUTiledBackend):
    """The CPU backend whose decode attention is paged_decode_attention, compiled."""

    name = "compiled"

    def __init__(self, device: torch.device | str, dtype: torch.dtype):
        super().__init__(device, dtype)
        # dynamic_threads: the C++ loops ask OpenMP for the thread count at run time (cpu_share.py
        # changes it), instead of baking in the count at compile time.
        self.decode_kernel = torch.compile(paged_decode_attention, dynamic=True, options={"cpp.dynamic_threads": True})

    def decode_group(self, layout: StepLayout, seqs: list[int]) -> DecodeGroup:
        """The eager group, shaped so that one compiled kernel serves every step (see `one_shape`)."""
        group = super().decode_group(layout, seqs)
        null_slot = layout.null_block * layout.block_size
        return one_shape(group, null_slot)

    def decode_attention(self, q, kv_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
        with part("attention"):  # the context read is fused into it: no "context read" part here
            # q is a strided view of the step's q/k/v projection when every row decodes, a contiguous copy
            # otherwise: one layout, one compiled kernel (Dynamo guards on strides too).
            return self.decode_kernel(q.contiguous(), kv_cache, group.slots, group.lens, scale)

    def warm_up(self, num_heads: int, num_kv_heads: int, head_dim: int, budget_s: float = WARM_UP_BUDGET_S):
        """Compile for these head shapes and check against the eager backend. Returns None when the
        compiled kernel may serve, else a sentence saying why not. Runs in a thread so a compile
        slower than `budget_s` cannot hold the start-up longer than that."""
        result: dict = {}

        def run():
            try:
                # Duck sizing off while compiling: S, L and the cache's sizes are never assumed equal
                # because they happened to be in a warm-up case. (Not around every call: 70 us each.)
                with fx_config.patch(use_duck_shape=False):
                    result["error"] = self._check(num_heads, num_kv_heads, head_dim)
            except Exception as e:  # no C++ compiler, an Inductor error: all mean "use eager"
                result["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"

        start = time.perf_counter()
        thread = threading.Thread(target=run, name="minfer-compile", daemon=True)
        thread.start()
        thread.join(budget_s)
        if thread.is_alive():
            return f"compiling took longer than its {budget_s:.0f} s budget"
        self.warm_up_seconds = time.perf_counter() - start
        return result["error"]

    @torch.inference_mode()  # as the engine runs it: Dynamo guards on it
    def _check(self, num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
        eager = CPUTiledBackend(self.device, self.dtype)
        gen = torch.Generator().manual_seed(0)
        block_size, num_blocks = 16, 12
        # Two layers' caches, so the kernel sees a layer view that does not start at offset 0; a normal
        # tensor, not an inference one, as the engine's (kv_cache.KVCache): Dynamo guards on the kind.
        with torch.inference_mode(False):
            cache = torch.randn(2, (num_blocks + 1) * block_size, 2, num_kv_heads, head_dim, generator=gen)
            cache = cache.to(self.dtype)
            cache[:, num_blocks * block_size :] = 0  # the null block
        tolerance = 1e-5 if self.dtype == torch.float32 else 2e-2
        # One sequence and several, contexts of 1 token and longer, on the first layer's cache (storage
        # offset 0) and the second's: every kernel the engine will need.
        cases = [([1], 0), ([37], 1), ([1, 5, 37], 0), ([16, 16], 1), ([3], 0)]
        for lens, layer in cases:
            tables = torch.randperm(num_blocks, generator=gen)[: 3 * len(lens)].view(len(lens), 3).tolist()
            layout = StepLayout(
                slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                query_starts=list(range(len(lens))),
                query_lens=[1] * len(lens),
                context_lens=lens,
                block_tables=tables,
                block_size=block_size,
                null_block=num_blocks,
            )
            q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(self.dtype)
            seqs = list(range(len(lens)))
            got = self.decode_attention(q, cache[layer], self.decode_group(layout, seqs), head_dim**-0.5)
            want = eager.decode_attention(q, cache[layer], eager.decode_group(layout, seqs), head_dim**-0.5)
            error = (got.float() - want.float()).abs().max().item()
            if not error <= tolerance:
                return f"its results differ from the eager backend's by {error:.2g} (contexts {lens})"
        return None
