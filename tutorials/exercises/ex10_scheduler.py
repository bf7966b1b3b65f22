"""Exercise 10: admit a waiting request, and preempt a running one, in the scheduling policy.

Write `admit` and `preempt`, which ContinuousBatcher.schedule calls: admit for the request at the
head of the waiting queue while budget, seats and blocks last; preempt when a running sequence cannot
grow (ContinuousBatcher.grow picks the newest running sequence and hands it to you). Then run

    python tutorials/10_online_scheduler.py --exercise

and the stage runs its requests with your functions in place of minfer's: its step tables, its
preemptions and its "every output equals the request run alone" asserts grade them. minfer's own are
ContinuousBatcher._admit and ContinuousBatcher._preempt in minfer/engine/continuous_batcher.py.

What you work with, on `self` (a ContinuousBatcher):
- self.allocator (a BlockAllocator: match_prefix, share, allocate, free, num_free_blocks,
  num_unreferenced), self.block_size;
- self.waiting (a deque) and self.running (a list, in admission order);
- self.num_preemptions, self.prefix_cache_hit_tokens and self.recompute_cache_hit_tokens: counters that
  stats() reports.
On a Sequence `seq`: seq.token_ids, seq.num_tokens, seq.block_table, seq.num_computed_tokens,
seq.num_cached_tokens, seq.num_recompute_cached_tokens, seq.max_cached_tokens (None, or how far a prefix
hit may reach),
seq.num_preemptions, seq.status (Status.WAITING / RUNNING, from minfer.engine.sequence).
cdiv (ceiling division) is in minfer.attention.kv_cache; ScheduledChunk in minfer.engine.sequence.
"""

from __future__ import annotations


def admit(self, seq, budget: int):
    """Give `seq` its first chunk of at most `budget` tokens, reusing its longest cached prefix, and
    return ScheduledChunk(seq, first token to compute, tokens to compute); or None if the blocks are
    not there (schedule then stops admitting for this step). The caller moves seq to running.

    1. Cached prefix: self.allocator.match_prefix over every token but the last (the last is always
       computed: its logits are needed to sample), cut to seq.max_cached_tokens // block_size blocks
       when that is not None. cached = its blocks x block_size tokens.
    2. The chunk: n = min(tokens left after the cached ones, budget), and the new blocks it needs
       beyond the hits: cdiv(cached + n, block_size) - len(hits).
    3. Enough free blocks? Hits that sit unreferenced in the free queue use up free blocks too
       (allocator.num_unreferenced(hits)). If new + those > allocator.num_free_blocks: return None.
    4. Take them: share the hits, allocate the new blocks; the block table is hits + new ones. Set
       seq.num_computed_tokens to cached. A first admission (seq.num_preemptions == 0) sets
       seq.num_cached_tokens to cached and adds it to self.prefix_cache_hit_tokens; a re-admission
       after a preemption (its hit may hold generated tokens too) adds it to
       seq.num_recompute_cached_tokens and self.recompute_cache_hit_tokens. Mark seq RUNNING.
    """
    raise NotImplementedError


def preempt(self, seq) -> None:
    """Take a running sequence off the batch to free its blocks; it is recomputed later.

    Remove it from self.running, free its blocks (self.allocator.free) and empty its block table,
    reset its computed tokens to 0, mark it WAITING, count the preemption (on seq and on self), and put
    it at the front of self.waiting: it was admitted before everything still waiting, so it goes first.
    """
    raise NotImplementedError
