"""The compiled attention backend: decode attention that reads the paged cache in place.

Eager torch must gather each sequence's keys and values out of the paged cache into a
buffer (and upcast bf16) before sdpa can read them, so the context crosses memory three
times. `paged_decode_attention` below says the same attention in plain torch, indexing the
cache through the block tables; torch.compile (Inductor: C++ loops on a CPU) fuses the
gather, the upcast, the scores, the masked softmax and the weighted sum, and the gathered
context is never stored. The function is the lesson; the compiler does the fusion.

- The cache is laid out for it (BlockedKVCache, below): block by block, each block's keys
  transposed, so the score's sum over head_dim runs across a block's positions as plain vector
  multiply-adds. Over rows of slots every position's score ended in a sum across one vector's
  lanes: the same function ran 1.6-2x slower.
- Decode rows (one query per sequence) run here: they are bound by reading the context.
- Prefill chunks keep the eager CPU path (gather, then two matmuls, or sdpa on an AMX CPU): a chunk
  of T queries does T x L work per context position read, so it is bound by compute, which matmul
  kernels do best. `chunk_context` gathers their blocks back into the rows that path reads.
- Compiled with dynamic=True, so batch size and context length never trigger a recompile
  while serving. Dynamo still guards on what else it sees: sizes of 1 (a lone sequence gets
  a kernel of its own, compiled by `warm_up`; `one_shape` pads a one-block context to 2),
  strides (q is made contiguous), and sizes that happen to be equal (duck sizing, switched
  off while `warm_up` compiles). `warm_up` compiles before the engine starts, on the first
  layer's cache and a later one's, and checks every result against the eager backend. If
  anything fails (no C++ compiler, a compile error, a mismatch, a compile slower than its
  time budget), the engine runs the eager backend instead and says why (engine/prepare.py).
- On a CPU `auto` compiles for a bf16/fp16 cache, and for fp32 where the CPU has AMX (selector.py).
- A lone sequence with a short context (`LONE_EAGER_MAX_CONTEXT`) is gathered and read by sdpa on a CPU
  where prefill chunks use sdpa (AMX): there its compiled call, cold between a layer's matmuls, cost more
  than the read it saves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.fx.experimental._config as fx_config

from ..host_to_device import to_device
from ..step_parts import part
from ..cpu.tiled_attention import CPUTiledBackend
from ..attention.kv_cache import KVCache, cdiv, padded_tables, slot_of
from ..attention.backend import StepLayout
from ..attention.torch_sdpa import DecodeGroup
from .precompiled import PrecompiledFunction
from .saved_graphs import CompileRecord, warm_up_saved

WARM_UP_BUDGET_S = 60.0  # longest the start-up compile may take before the engine gives up on it
# A lone sequence with at most this much context decodes by gather + sdpa where prefill chunks use sdpa
# (an AMX CPU): in the engine, between a layer's matmuls, the compiled call met its code and data cold
# and cost ~170 us, about 60 more than the eager read, and slowed the matmuls after it.
LONE_EAGER_MAX_CONTEXT = 256


def paged_decode_attention(
    q: torch.Tensor,  # (S, H, D): one query per sequence
    kv_cache: torch.Tensor,  # (num_blocks, 2, Hkv, D * B): one layer's blocks, keys transposed (kv_cache.py, "blocks")
    tables: torch.Tensor,  # (S, NB): each sequence's blocks; padding names the zeroed null block
    lens: torch.Tensor,  # (S,): each sequence's context length; positions past it are masked
    scale: float,
    block_size: int,  # B: a Python int, so the compiler knows it
) -> torch.Tensor:  # (S, H, D)
    S, H, D = q.shape
    Hkv, B, NB = kv_cache.shape[2], block_size, tables.shape[1]
    G = H // Hkv  # query heads per key/value head (grouped-query attention; 1 for GPT-2)
    blocks = kv_cache[tables]  # (S, NB, 2, Hkv, D * B): compiled, read in place, never stored
    keys = blocks[:, :, 0].view(S, NB, Hkv, 1, D, B).float()  # a block's B positions side by side
    values = blocks[:, :, 1].view(S, NB, Hkv, 1, B, D).float()
    queries = q.float().view(S, 1, Hkv, G, D, 1)  # a group of G query heads shares one key/value head
    # The sum runs over D, not over the contiguous axis: B positions are scored at once, one vector.
    scores = (queries * keys).sum(4) * scale  # (S, NB, Hkv, G, B)
    position = torch.arange(NB * B, device=q.device).view(1, NB, 1, 1, B)
    valid = position < lens.view(S, 1, 1, 1, 1)  # (S, NB, 1, 1, B)
    scores = scores.masked_fill(~valid, float("-inf"))
    # softmax over each sequence's context: its blocks and their positions, axes 1 and 4
    weights = torch.exp(scores - scores.amax((1, 4), keepdim=True))
    weights = weights / weights.sum((1, 4), keepdim=True)  # (S, NB, Hkv, G, B)
    # Unwritten slots of a last block may hold anything, NaN too (0 * NaN is NaN): mask them out.
    values = values.masked_fill(~valid[..., None], 0.0)
    per_block = (weights[..., None] * values).sum(4)  # (S, NB, Hkv, G, D): a block's rows stay in cache
    return per_block.sum(1).reshape(S, H, D).to(q.dtype)


def failure_line(error: Exception) -> str:
    """Why compiling failed, for one log line: "TypeName: the message's first line"."""
    message = str(error).strip()
    return f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"


_ONE_COMPILE_AT_A_TIME = threading.Lock()


def check_within(check: Callable[[], str | None], budget_s: float) -> tuple[str | None, float | None]:
    """Run a backend's compile-and-check in a thread, so that a compile slower than `budget_s` cannot hold
    the start-up longer than that: (None, or why the backend may not serve; seconds taken, or None). An
    exception (no C++ compiler, an Inductor error) is a reason, in one line."""
    result: dict = {}

    def run():
        with _ONE_COMPILE_AT_A_TIME:  # an abandoned compile still running holds it: Dynamo is not thread-safe
            try:
                result["why_not"] = check()
            except Exception as e:
                result["why_not"] = failure_line(e)

    start = time.perf_counter()
    thread = threading.Thread(target=run, name="minfer-compile", daemon=True)
    thread.start()
    thread.join(budget_s)
    if thread.is_alive():
        return f"compiling took longer than its {budget_s:.0f} s budget", None
    return result["why_not"], time.perf_counter() - start


def one_shape(group: DecodeGroup, null_block: int) -> DecodeGroup:
    """Dynamic shapes still specialise sizes of 1, so contexts that all fit in one block would compile
    a kernel of their own: they get a padding column (the zeroed null block, masked), a cached read.
    (A lone sequence is not padded: a padding row would double a batch-1 step's attention; `warm_up`
    compiles that kernel too.) lens gets its own storage: as a view into the group's (2, S) tensor its
    storage offset is S, which the kernel would guard on too."""
    tables, lens = group.tables, group.lens.clone()  # (S, NB), (S,)
    if tables.shape[1] == 1:
        tables = torch.cat((tables, torch.full_like(tables, null_block)), dim=1)  # (S, 2)
    return replace(group, tables=tables, lens=lens)


class CompiledBackend(CPUTiledBackend):
    """The CPU backend whose decode attention is paged_decode_attention, compiled, on a cache laid out
    in blocks with transposed keys (kv_cache.py). Prefill chunks that read earlier context gather
    their blocks back into rows and attend as the eager backend does."""

    name = "compiled"
    traces_lone_decode = True

    def __init__(self, device: torch.device | str, dtype: torch.dtype):
        super().__init__(device, dtype)
        self.decode_kernel = PrecompiledFunction(paged_decode_attention, "paged_decode_attention")
        self.compile_record: CompileRecord | None = None  # how warm_up had its graphs: loaded or compiled
        self.block_size = 16  # the engine's, from each step's layout
        self.lone_eager_max_context = LONE_EAGER_MAX_CONTEXT if self.flash_prefill else 0
        # Set by the engine under --compile-model: a lone sequence's decode attention is traced into the
        # frozen whole-forward graph (`traced_lone_decode`) rather than called there as one opaque op, whose
        # Python (~20 small eager ops) cost 200-280 us a layer, a quarter of an int8 GPT-2 step.
        self.lone_decode_in_graph = False

    def new_cache(self, config, num_blocks: int, block_size: int, device, dtype) -> KVCache:
        return BlockedKVCache(config, num_blocks, block_size, device, dtype)

    def build_metadata(self, layout: StepLayout):
        self.block_size = layout.block_size
        return super().build_metadata(layout)

    def decode_group(self, layout: StepLayout, seqs: list[int]) -> DecodeGroup:
        """Each sequence's block table, padded with the null block to the group's longest, and its length:
        one compiled kernel serves every step (see `one_shape`). A lone sequence with a short context is
        read eagerly as a prefill chunk's is, where that path is sdpa: its group carries the context's
        slots (and, under `lone_decode_in_graph`, its table too, for `traced_lone_decode`)."""
        rows = [layout.query_starts[i] for i in seqs]
        lens = [layout.context_lens[i] for i in seqs]
        slots = None
        if len(seqs) == 1 and lens[0] <= self.lone_eager_max_context:
            table = torch.tensor(layout.block_tables[seqs[0]][: cdiv(lens[0], layout.block_size)])
            slots = slot_of(table, torch.arange(lens[0]), layout.block_size)  # (L,)
            if not self.lone_decode_in_graph:  # read eagerly only: no table needed
                return DecodeGroup(rows=torch.tensor(rows), slots=slots, mask=None)
        num_blocks = cdiv(max(lens), layout.block_size)
        padded = padded_tables([layout.block_tables[i] for i in seqs], num_blocks, layout.null_block)
        ints = to_device([rows, lens], self.device)  # (2, S)
        tables_t = to_device(padded, self.device)  # (S, NB)
        group = DecodeGroup(rows=ints[0], slots=slots, mask=None, lens=ints[1], tables=tables_t)
        return one_shape(group, layout.null_block)

    def decode_attention(self, q, kv_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
        if group.slots is not None:  # a lone short sequence (decode_group): read as a one-token prefill chunk
            with part("context read"):
                keys, values = self.chunk_context(kv_cache, group.slots)  # (Hkv, L, D) each, the cache's dtype
            with part("attention"):
                return self.prefill_attention(q.transpose(0, 1), keys, values, None, scale).transpose(0, 1)  # (1, H, D)
        with part("attention"):  # the context read is fused into it: no "context read" part here
            # q is a strided view of the step's q/k/v projection when every row decodes, a contiguous copy
            # otherwise: one layout, one compiled kernel (Dynamo guards on strides too). Not q.contiguous(): a
            # lone row's view counts as contiguous, keeping a stride no warm-up graph was compiled for.
            S, H, D = q.shape
            if q.stride() != (H * D, D, 1):
                q = q.clone(memory_format=torch.contiguous_format)
            return self.decode_kernel(q, kv_cache, group.tables, group.lens, scale, self.block_size)

    def traced_lone_decode(self, q, k, v, kv_cache, meta, scale: float, cache_is_input: bool = False) -> torch.Tensor:
        """A lone sequence's decode step, traced into the whole-forward graph (`lone_decode_in_graph`): the
        K/V write, then paged_decode_attention, which Inductor fuses with the ops around it."""
        slots, tables, lens = lone_decode_tensors(meta)
        if cache_is_input:  # a package's graph (packaged.py): the write is traced in and fused too
            store_kv_without_views(kv_cache, slots, k, v, self.block_size)
        else:  # a layer of the whole cache (compiled in memory): the op writes it in place
            torch.ops.minfer.store_kv(kv_cache, slots, k, v, self.block_size)
        return paged_decode_attention(q, kv_cache, tables, lens, scale, self.block_size)  # (1, H, D)

    def write_kv(self, kv_cache, slots, k, v) -> None:
        store_kv(kv_cache, slots, k, v, self.block_size)

    def chunk_context(self, kv_cache, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's context, slots (L,) of positions 0..L-1 -> keys and values (Hkv, L, D) each, for
        the eager prefill attention (cpu/tiled_attention.py): the sequence's blocks gathered whole. For its matmuls
        they are upcast to fp32 and the keys stay transposed, as the matmul wants them: (Hkv, D, L) in
        memory, a (Hkv, L, D) view. For sdpa (`flash_prefill`) they keep the cache's dtype, in rows of D."""
        B, L, (_, _, Hkv, DB) = self.block_size, slots.shape[0], kv_cache.shape
        table = slots[::B] // B  # (NB,): slot j * B starts the sequence's block j
        NB, D = table.shape[0], DB // B
        dtype = kv_cache.dtype if self.flash_prefill else self.reader.dtype_read(kv_cache.dtype)
        size = Hkv * D * NB * B  # buffers the reader reuses: fresh ones would page-fault on first touch
        blocks = self.reader.buffer("blocks", kv_cache.dtype, kv_cache.device, 2 * size).view(NB, 2, Hkv, DB)
        torch.index_select(kv_cache, 0, table, out=blocks)  # (NB, 2, Hkv, D * B)
        block_keys = blocks[:, 0].view(NB, Hkv, D, B)
        values = self.reader.buffer("values", dtype, blocks.device, size).view(Hkv, NB, B, D)
        values.copy_(blocks[:, 1].view(NB, Hkv, B, D).transpose(0, 1))  # runs of a block's rows
        values = values.view(Hkv, NB * B, D)[:, :L]
        if self.flash_prefill:
            keys = self.reader.buffer("keys", dtype, blocks.device, size).view(Hkv, NB, B, D)
            keys.copy_(block_keys.permute(1, 0, 3, 2))  # each block's keys back into rows
            return keys.view(Hkv, NB * B, D)[:, :L], values
        keys = self.reader.buffer("keys", dtype, blocks.device, size).view(Hkv, D, NB, B)
        keys.copy_(block_keys.permute(1, 2, 0, 3))  # runs of B positions
        return keys.view(Hkv, D, NB * B)[:, :, :L].transpose(1, 2), values

    def warm_up(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int = 16, budget_s: float = WARM_UP_BUDGET_S
    ):
        """Compile for these head shapes and check against the eager backend. Returns None when the
        compiled kernel may serve, else a sentence saying why not. Runs in a thread so a compile
        slower than `budget_s` cannot hold the start-up longer than that."""

        def check():
            lone_eager_max_context, self.lone_eager_max_context = self.lone_eager_max_context, 0  # compile all
            try:
                # Duck sizing off while compiling: S, L and the cache's sizes are never assumed equal
                # because they happened to be in a warm-up case. (Not around every call: 70 us each.)
                with fx_config.patch(use_duck_shape=False):
                    return self._check(num_heads, num_kv_heads, head_dim, block_size)
            finally:
                self.lone_eager_max_context = lone_eager_max_context

        def check_saved():  # the graphs from minfer's compile cache where it has them (saved_graphs.py)
            shapes = {"dtype": str(self.dtype), "heads": [num_heads, num_kv_heads, head_dim], "block_size": block_size}
            why_not, self.compile_record = warm_up_saved("attention", [self.decode_kernel], shapes, check, self.device)
            return why_not

        why_not, self.warm_up_seconds = check_within(check_saved, budget_s)
        return why_not

    @torch.inference_mode()  # as the engine runs it: Dynamo guards on it
    def _check(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
        eager = CPUTiledBackend(self.device, self.dtype)
        gen = torch.Generator().manual_seed(0)
        num_blocks = 12
        self.block_size = block_size
        # Two layers' caches, so the kernel sees a layer view that does not start at offset 0; a normal
        # tensor, not an inference one, as the engine's (kv_cache.KVCache): Dynamo guards on the kind.
        # The eager backend reads the same keys and values in its own layout.
        with torch.inference_mode(False):
            rows = torch.randn(2, (num_blocks + 1) * block_size, 2, num_kv_heads, head_dim, generator=gen)
            rows = rows.to(self.dtype)
            rows[:, num_blocks * block_size :] = 0  # the null block
            cache = slots_to_blocks(rows, block_size)
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
            want = eager.decode_attention(q, rows[layer], eager.decode_group(layout, seqs), head_dim**-0.5)
            error = (got.float() - want.float()).abs().max().item()
            if not error <= tolerance:
                return f"its results differ from the eager backend's by {error:.2g} (contexts {lens})"
        return None


class BlockedKVCache(KVCache):
    """The compiled backend's cache: `kv` is (num_layers, num_blocks + 1, 2, num_kv_heads, head_dim *
    block_size), a block's keys then its values, each head's together. Keys are stored transposed,
    (head_dim, block_size) per head, so a block's positions sit side by side and a dot product with the
    query runs across positions as plain vector adds; values stay (block_size, head_dim). Slot s is
    position s % block_size of block s // block_size, as in the plain cache. `k` and `v` are views:
    (num_layers, num_blocks + 1, num_kv_heads, head_dim, block_size) and (..., block_size, head_dim)."""

    def __init__(self, config, num_blocks: int, block_size: int, device, dtype):
        L, Hkv, D = config.num_layers, config.num_kv_heads, config.head_dim
        self.null_block, self.block_size = num_blocks, block_size
        with torch.inference_mode(False):  # a normal tensor whoever builds it: compiled kernels guard on the kind
            self.kv = torch.empty((L, num_blocks + 1, 2, Hkv, D * block_size), device=device, dtype=dtype)
        self.kv[:, num_blocks:].zero_()
        self.k = self.kv[:, :, 0].view(L, num_blocks + 1, Hkv, D, block_size)  # a block's keys, transposed
        self.v = self.kv[:, :, 1].view(L, num_blocks + 1, Hkv, block_size, D)

    def block_rows(self, blocks: list[int]) -> torch.Tensor:
        return to_device(blocks, self.kv.device)  # a block is one entry along kv's second axis


def slots_to_blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys and values in the plain cache's layout, (..., num_slots, 2, Hkv, D), copied into the blocked
    one, (..., num_slots / block_size, 2, Hkv, D * block_size) (BlockedKVCache)."""
    *lead, num_slots, _, Hkv, D = kv.shape
    rows = kv.reshape(*lead, num_slots // block_size, block_size, 2, Hkv, D)  # (..., nb, B, 2, Hkv, D)
    keys = rows.select(-3, 0).movedim(-3, -1)  # (..., nb, Hkv, D, B)
    values = rows.select(-3, 1).movedim(-3, -2)  # (..., nb, Hkv, B, D)
    return torch.stack((keys.flatten(-2), values.flatten(-2)), dim=-3)  # (..., nb, 2, Hkv, D * B)


def store_kv(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> None:
    """Store k and v (N, Hkv, D) at their slots (N,) of kv_cache (num_blocks, 2, Hkv, D * B): slot s is
    position s % B of block s // B, a column of the block's transposed keys and a row of its values."""
    B, (_, Hkv, D) = block_size, k.shape
    blocks, offsets = slots // B, slots % B  # (N,), (N,)
    kv_cache[:, 0].view(-1, Hkv, D, B)[blocks, :, :, offsets] = k  # indexes (N, Hkv, D)
    kv_cache[:, 1].view(-1, Hkv, B, D)[blocks, :, offsets] = v


def store_kv_without_views(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           block_size: int) -> None:
    """store_kv as one index_put_ into kv_cache itself, through no view of it: where kv_cache is a graph's
    input, the compiler writes it in place, fused with the ops around it (written through a view, a graph's
    functional form would copy the whole cache)."""
    B, (N, Hkv, D) = block_size, k.shape
    blocks, offsets = slots // B, slots % B  # (N,)
    d = torch.arange(D, device=k.device)
    # a key's column d * B + offset of its block's (D, B) keys; a value's row offset, at offset * D + d
    columns = torch.stack((d * B + offsets[:, None], offsets[:, None] * D + d), 1)  # (N, 2, D)
    halves = torch.arange(2, device=k.device).view(1, 2, 1, 1)
    heads = torch.arange(Hkv, device=k.device).view(1, 1, Hkv, 1)
    index = (blocks.view(N, 1, 1, 1), halves, heads, columns.view(N, 2, 1, D))  # broadcast to (N, 2, Hkv, D)
    kv_cache.index_put_(index, torch.stack((k, v), 1))  # (N, 2, Hkv, D)


# store_kv as an op, its mutation declared (the "!"), for a graph compiled in memory, whose layers' caches are
# views of one input: there it writes the cache in place, where plain indexing made the compiler keep the graph
# functional by copying each layer's whole cache. Registered directly, not with torch.library.custom_op, whose
# wrapper cost 19 us a call against 9.
_ops = torch.library.Library("minfer", "FRAGMENT")
_ops.define("store_kv(Tensor(a!) kv_cache, Tensor slots, Tensor k, Tensor v, int block_size) -> ()")
_ops.impl("store_kv", store_kv, "CompositeExplicitAutograd")


def lone_decode_tensors(meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What traced_lone_decode reads of a lone decode's metadata: its slot (1,), block table (1, NB) and
    context length (1,). A graph kept on disk takes them as inputs (packaged.py)."""
    group = meta.decode_groups[0]
    return meta.slot_mapping, group.tables, group.lens


def with_lone_decode_tensors(meta, slot_mapping, tables, lens):
    """`meta` with those three replaced: the inverse of lone_decode_tensors."""
    group = replace(meta.decode_groups[0], tables=tables, lens=lens)
    return replace(meta, slot_mapping=slot_mapping, decode_groups=[group])
