"""The paged KV cache: preallocated tensors, a block allocator and the prefix-cache index.

Every layer's keys and values live in one preallocated tensor of
`num_blocks * block_size` token slots. A sequence owns a *block table*: the list
of block ids that hold its tokens, in order, so token `p` of a sequence lives in
slot `table[p // block_size] * block_size + p % block_size` (`slot_of`) — the same
trick as virtual memory pages.

Prefix caching: a full block is named by a hash chained over (parent block's
hash, the block's token ids). When a new request starts with the same tokens,
it reuses those blocks instead of recomputing them. A block that nobody
references any more keeps its contents and its hash, and sits in the free queue
until the allocator needs it (least recently freed first), so cached blocks are
always reclaimable and the cache can never cause an out-of-blocks failure.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .config import ModelConfig


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: how many blocks hold `a` tokens (a partly filled block is still a block)."""
    return -(-a // b)


def slot_of(block_table, position, block_size: int):
    """The cache slot of token `position` of a sequence: table[p // block_size] * block_size + p % block_size.
    Takes a list table and an int position, or tensors: a (..., num_blocks) table and (L,) positions
    give (..., L) slots."""
    index = position // block_size
    block = block_table[..., index] if isinstance(block_table, torch.Tensor) else block_table[index]
    return block * block_size + position % block_size


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix index
    token_ids: tuple[int, ...] = field(default=())  # kept to verify a hash hit, never trusted blindly


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash: a block's identity includes every token before it."""
    return hash((parent_hash, token_ids))


class BlockAllocator:
    """Hands out block ids, counts references, and indexes full blocks for prefix reuse."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first. An OrderedDict gives O(1)
        # pop-from-front, append and removal from the middle (when a cached block is hit).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: truly empty ones plus unreferenced cached ones."""
        return len(self.free_queue)

    def block_state(self, block_id: int) -> str:
        """ "used" (referenced), "cached" (unreferenced but holding a registered prefix: reclaimable) or "free"."""
        block = self.blocks[block_id]
        if block.ref_count:
            return "used"
        return "cached" if block.hash is not None else "free"

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest run of cached full blocks that starts `token_ids`. No side effects."""
        if not self.enable_prefix_caching:
            return []
        hits, parent, block_size = [], None, self.block_size
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            chunk = tuple(token_ids[start : start + block_size])
            h = block_hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break  # a miss, or a hash collision caught by comparing the tokens
            hits.append(block_id)
            parent = h
        return hits

    def num_unreferenced(self, block_ids: list[int]) -> int:
        """How many of these (cached) blocks sit in the free queue; reusing them uses up free blocks."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def share(self, block_ids: list[int]) -> None:
        """Take a reference to blocks that already hold the right tokens (prefix-cache hits)."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free_queue[b]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        """n empty blocks with one reference each; evicts the least recently used cached blocks."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            block = self.blocks[b]
            if block.hash is not None:  # evict: its old contents are about to be overwritten
                if self.cached.get(block.hash) == b:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            out.append(b)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. Freed in reverse, so a sequence's tail is evicted
        before its head: the head is the part other requests are likeliest to share."""
        for b in reversed(block_ids):
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {b} freed more often than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None or not self.enable_prefix_caching:
                    block.hash, block.token_ids = None, ()
                self.free_queue[b] = None

    def register(self, block_id: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        """Name a block that just became full, so later requests can find it. Returns its hash."""
        h = block_hash(parent_hash, token_ids)
        if self.enable_prefix_caching and h not in self.cached:
            block = self.blocks[block_id]
            block.hash, block.token_ids = h, token_ids
            self.cached[h] = block_id
        return h

    def check_invariants(self, live_tables: list[list[int]] = ()) -> None:
        """Assert the bookkeeping is consistent (tests call this; cheap enough for debugging)."""
        refs = [0] * self.num_blocks
        for table in live_tables:
            for b in table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref count mismatch"
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), f"block {block.block_id}"
        for h, b in self.cached.items():
            assert self.blocks[b].hash == h and len(self.blocks[b].token_ids) == self.block_size


class KVCache:
    """The preallocated keys and values, side by side: `kv` is (num_layers, (num_blocks + 1) * block_size,
    2, num_kv_heads, head_dim), a slot's key next to its value, so one gather reads both (contiguous rows
    of 2 x num_kv_heads x head_dim; paged_attention). `k` and `v` are views of its two halves. With
    grouped-query attention only the key/value heads are stored, fewer than the query heads.

    Block `num_blocks` is an extra, never-allocated *null block*, kept zeroed: padded
    positions of a batched gather read it. Everything else starts uninitialised
    (torch.empty): a slot is always written before attention reads it unmasked, and
    untouched memory costs no RAM until used. Masked reads must still be finite
    (0 * NaN = NaN in the attention sum), hence the zeroed null block.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device, dtype):
        num_slots = (num_blocks + 1) * block_size
        shape = (config.num_layers, num_slots, 2, config.num_kv_heads, config.head_dim)
        self.null_block = num_blocks
        self.kv = torch.empty(shape, device=device, dtype=dtype)
        self.kv[:, num_blocks * block_size :].zero_()
        self.k, self.v = self.kv[:, :, 0], self.kv[:, :, 1]  # (num_layers, num_slots, num_kv_heads, head_dim)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        token_bytes = config.num_layers * config.num_kv_heads * config.head_dim * element
        return 2 * block_size * token_bytes  # keys + values


def available_memory(device: torch.device) -> int:
    """Free bytes on the device: free GPU memory, or MemAvailable from /proc/meminfo on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


LONGEST_REQUIRED = 8192  # tokens: the longest sequence a KV cache budget must be able to hold


def choose_num_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
) -> int:
    """Size the cache from a budget: bytes, or a fraction of free memory (default 0.9 on a GPU,
    0.25 on CPU). Never more than every running sequence at full context could use
    (plus as much again to keep prefixes cached) — more would be memory held for nothing. The budget
    must hold one sequence of the full context, or of LONGEST_REQUIRED tokens for long-context
    models (Qwen3's 40960 would need GBs): the scheduler refuses requests longer than the cache."""
    per_block = KVCache.bytes_per_block(config, block_size, dtype)
    if memory_bytes is None:
        fraction = memory_fraction if memory_fraction is not None else (0.9 if device.type == "cuda" else 0.25)
        if not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {fraction}")
        memory_bytes = int(available_memory(device) * fraction)
    blocks_per_seq = cdiv(config.max_positions, block_size)
    num_blocks = min(memory_bytes // per_block, 2 * max_num_seqs * blocks_per_seq)
    needed = min(blocks_per_seq, cdiv(LONGEST_REQUIRED, block_size))
    if num_blocks < needed:
        length = "full-length" if needed == blocks_per_seq else f"{LONGEST_REQUIRED}-token"
        raise ValueError(
            f"the KV cache budget of {memory_bytes / 2**20:.2f} MiB holds {num_blocks} blocks, "
            f"fewer than the {needed} one {length} sequence needs; give more memory or num_kv_blocks"
        )
    return int(num_blocks)
