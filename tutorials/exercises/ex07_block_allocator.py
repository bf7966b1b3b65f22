"""Exercise 07: hand out KV blocks and take them back, counting references.

Write `allocate` and `free`, the two methods of minfer's BlockAllocator that every other part of
the engine relies on. Then run

    python tutorials/07_block_allocator.py --exercise

and the stage runs with your two functions in place of minfer's (in its hand-driven part and inside
the whole engine at its end): its asserts grade them. minfer's own are BlockAllocator.allocate and
BlockAllocator.free in minfer/engine/block_allocator.py; read them after you have tried.

What you work with, on `self` (a BlockAllocator; its __init__ sets these up):
- self.blocks: list[Block], one per block id; a Block has .ref_count, .hash and .token_ids
  (hash and token_ids are set when the block is full and findable by prefix caching, stage 09);
- self.free_queue: an OrderedDict whose keys are the ids with ref_count 0, least recently freed
  first. popitem(last=False) takes from the front; `self.free_queue[b] = None` appends at the back;
- self.cached: dict, block hash -> block id: the prefix index (stage 09);
- self._num_shared: how many blocks have ref_count > 1 (stats and invariants read it).
"""

from __future__ import annotations


def allocate(self, n: int) -> list[int]:
    """n empty blocks, each with one reference; returns their ids in the order taken.

    - Asking for more than are free raises RuntimeError (a sentence saying how many were asked and free).
    - Take ids from the front of the free queue: the least recently freed first.
    - A block taken may still hold a cached prefix (block.hash is not None). It is about to be
      overwritten: evict it, deleting its entry from self.cached if that entry points at this block,
      and set its hash to None and token_ids to ().
    - Each block taken gets ref_count 1.
    """
    raise NotImplementedError


def free(self, block_ids: list[int]) -> None:
    """Drop one reference to each block of block_ids.

    - Walk the list in reverse: a sequence's tail then reaches the free queue before its head, so
      the head (the part other requests are likeliest to share) is evicted last.
    - A block freed more often than it was taken (ref_count already 0) raises RuntimeError.
    - When a block's count drops from 2 to 1 it is no longer shared: self._num_shared goes down by one.
    - A block whose count reaches 0 goes to the back of the free queue. Keep its hash (it stays findable
      by prefix caching until evicted), unless self.cached does not point at it (a twin of another
      block with the same tokens): then nobody can find it, so clear its hash and token_ids.
    """
    raise NotImplementedError
