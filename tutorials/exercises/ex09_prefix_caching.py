"""Exercise 09: name full blocks by a chained hash, and find a prompt's longest cached prefix.

Write `register_full_blocks` and `match_prefix`, BlockAllocator's prefix index. Then run

    python tutorials/09_prefix_caching.py --exercise

and the stage runs with your two functions in place of minfer's (by hand, then inside the engine,
where a hit must skip prefill work without changing a single output token): its asserts grade them.
minfer's own are BlockAllocator.register_full_blocks and BlockAllocator.match_prefix in
minfer/engine/block_allocator.py.

What you work with, on `self` (a BlockAllocator):
- self.block_size, self.enable_prefix_caching (False: neither function does anything);
- self.blocks: list[Block], one per block id, each with .hash (None until registered) and .token_ids;
- self.cached: dict, block hash -> block id, the index `match_prefix` looks up;
- block_hash(parent_hash, token_ids_tuple) from minfer.engine.block_allocator: the chained hash. A
  block's name covers every token before it: the first full block chains on None.
"""

from __future__ import annotations


def register_full_blocks(self, block_table: list[int], token_ids: list[int], num_computed_tokens: int) -> None:
    """Make the sequence's blocks that are full of computed keys and values findable.

    The first num_computed_tokens // block_size blocks of block_table are full. Give each one not yet
    hashed its token_ids (a tuple of its block_size tokens) and its hash, chained on the hash of the
    block before it, and index it in self.cached, unless that hash is already indexed (a twin computed
    by another sequence at the same time keeps its hash, so the chain goes on, but the index keeps
    pointing at the first). The scheduler calls this after every step: hash only what is new (the
    blocks before the first unhashed one already carry their hashes).
    """
    raise NotImplementedError


def match_prefix(self, token_ids: list[int]) -> list[int]:
    """Block ids of the longest run of cached full blocks that starts token_ids; no side effects.

    Walk token_ids a full block at a time, chaining the hash as register_full_blocks does, and stop at
    the first block whose hash is not in self.cached, or whose cached block holds other tokens (a hash
    collision: compare the tokens, never trust a hash alone). A partial last block never matches.
    """
    raise NotImplementedError
