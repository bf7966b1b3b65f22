"""The block allocator and the prefix-cache index: which KV blocks each sequence holds.

A sequence owns a *block table*: the list of block ids that hold its tokens, in order
(attention/kv_cache.py turns a table and a position into a cache slot).

Prefix caching: a full block is named by a hash chained over (parent block's hash, the block's token ids).
When a new request starts with the same tokens, it reuses those blocks instead of recomputing them. A block
that nobody references any more keeps its contents and its hash, and sits in the free queue until the
allocator needs it (least recently freed first), so cached blocks are always reclaimable and the cache can
never cause an out-of-blocks failure.

This class is the one owner of the hash chain: callers hand it token ids and block tables
(`register_full_blocks`, `match_prefix`) and never see a hash. A block's hash is kept on the block itself,
so a sequence carries no chain state: nothing to reset when it is preempted, nothing to leak when it ends.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its K/V computed (register_full_blocks)
    token_ids: tuple[int, ...] = field(default=())  # kept to verify a hash hit, never trusted blindly


def state_of(block: Block) -> str:
    """ "used" (referenced), "cached" (unreferenced but holding a registered prefix: reclaimable) or "free"."""
    if block.ref_count:
        return "used"
    return "cached" if block.hash is not None else "free"


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
        self._num_shared = 0  # blocks with ref_count > 1, counted as references come and go

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: truly empty ones plus unreferenced cached ones."""
        return len(self.free_queue)

    def block_state(self, block_id: int) -> str:
        return state_of(self.blocks[block_id])

    def block_states(self) -> list[str]:
        """Every block's state, in one pass: for a snapshot of a 100,000-block cache, half the time of
        100,000 block_state calls."""
        return [state_of(b) for b in self.blocks]

    def shared_block_ids(self) -> list[int]:
        """The blocks is_shared names, in order."""
        return [b.block_id for b in self.blocks if b.ref_count > 1]

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

    def is_shared(self, block_id: int) -> bool:
        """Held by more than one sequence (a prefix hit, or a fork's prompt): written only after a copy."""
        return self.blocks[block_id].ref_count > 1

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence: each is one block of memory, however many hold it."""
        return self._num_shared

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
            self._num_shared += block.ref_count == 2

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
            self._num_shared -= block.ref_count == 1
            if block.ref_count == 0:
                if block.hash is not None and self.cached.get(block.hash) != b:  # a twin: no one can find it
                    block.hash, block.token_ids = None, ()
                self.free_queue[b] = None

    def register_full_blocks(self, block_table: list[int], token_ids: list[int], num_computed_tokens: int) -> None:
        """Make a sequence's blocks that are now full of computed K/V findable by later requests. Cheap after every
        step: it hashes only the full blocks not hashed yet (a tail: a prefix hit or an earlier call did the rest)."""
        if not self.enable_prefix_caching:
            return
        block_size, blocks = self.block_size, self.blocks
        first = num_full = num_computed_tokens // block_size
        while first > 0 and blocks[block_table[first - 1]].hash is None:
            first -= 1
        parent = blocks[block_table[first - 1]].hash if first else None
        for i in range(first, num_full):
            block = blocks[block_table[i]]
            block.token_ids = tuple(token_ids[i * block_size : (i + 1) * block_size])
            block.hash = parent = block_hash(parent, block.token_ids)
            # A twin (the same tokens, computed by another sequence at the same time) keeps its hash,
            # so the chain goes on through it, but the index keeps pointing at the first.
            self.cached.setdefault(parent, block.block_id)

    def check_invariants(self, live_tables: list[list[int]] = ()) -> None:
        """Assert the bookkeeping is consistent (tests call this; cheap enough for debugging)."""
        refs = [0] * self.num_blocks
        for table in live_tables:
            for b in table:
                refs[b] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref count mismatch"
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), f"block {block.block_id}"
        assert self._num_shared == sum(1 for r in refs if r > 1), "shared block count"
        for h, b in self.cached.items():
            assert self.blocks[b].hash == h and len(self.blocks[b].token_ids) == self.block_size
        for block in self.blocks:  # an unreferenced block with a hash is one a request can still find
            assert block.ref_count or block.hash is None or self.cached.get(block.hash) == block.block_id
