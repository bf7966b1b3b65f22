"""n completions of one prompt on its shared KV blocks: forks.

Without this room a request with n > 1 is n sequences, each computing the prompt (as vLLM v1's
child requests do, sharing only what the prefix cache already holds). With it, the prompt is computed
and stored once:
- `hold`: choice 0 queues and runs the prefill; the other n - 1 wait here. Choice 0 holds n of the
  batch's sequence seats meanwhile, so that they fit when they start;
- `add_samplers`: the chunk that ends the prompt samples its last row once for every choice, each with
  its own generator (choice i seeded seed + i): the forks' first tokens come from the same logits;
- `start`: after that step the forks start running on the prompt's blocks: one more reference to each
  full block, no copy. The last block, if partly full, is the next token's: each fork gets a copy of it
  (`KVCache.copy_blocks`) and writes its own; choice 0 keeps the original. Where no block is free for
  a copy, the fork shares the full blocks only and computes the partial block's tokens again (they are
  the prompt's: the same keys and values).
Each choice then runs, finishes and frees its blocks on its own.
"""

from __future__ import annotations

from ..attention.kv_cache import KVCache
from ..engine.continuous_batcher import ContinuousBatcher
from ..engine.sequence import ScheduledChunk, Sequence


class Forks:
    def __init__(self):
        self.held: dict[Sequence, list[Sequence]] = {}  # choice 0 -> the choices that start from its prompt
        self.num_forks = 0
        self.num_copies = 0  # partial last blocks copied for a fork

    def hold(self, seqs: list[Sequence]) -> list[Sequence]:
        """A request's choices -> those to queue now: choice 0 alone, holding every choice's seat."""
        if len(seqs) == 1:
            return seqs
        first = seqs[0]
        self.held[first] = seqs[1:]
        first.seats = len(seqs)
        return [first]

    def add_samplers(self, chunks: list[ScheduledChunk]) -> None:
        """A chunk that ends a held prompt draws a token for every choice from its last row."""
        for chunk in chunks:
            forks = self.held.get(chunk.seq)
            if forks and chunk.samplers:
                chunk.samplers = [chunk.seq, *forks]

    def start(self, chunks: list[ScheduledChunk], batcher: ContinuousBatcher, kv_cache: KVCache) -> None:
        """The forks of every prompt that ended this step start running on its blocks (its K/V are in
        the cache: batcher.advance has counted them)."""
        for chunk in chunks:
            if len(chunk.samplers) > 1:
                self._start(chunk.seq, self.held.pop(chunk.seq), batcher, kv_cache)

    def _start(self, first: Sequence, forks: list[Sequence], batcher: ContinuousBatcher, kv_cache: KVCache) -> None:
        allocator, block_size = batcher.allocator, batcher.block_size
        first.seats = 1
        num_full = first.num_computed_tokens // block_size
        partial = first.block_table[num_full:]  # the block the next token goes into, if partly full
        for fork in forks:
            fork.block_table = first.block_table[:num_full]
            allocator.share(fork.block_table)
            fork.num_computed_tokens = num_full * block_size
            if partial and allocator.num_free_blocks:
                (own,) = allocator.allocate(1)
                kv_cache.copy_blocks([(partial[0], own)])
                fork.block_table.append(own)
                fork.num_computed_tokens = first.num_computed_tokens
                self.num_copies += 1
            fork.num_cached_tokens = first.num_cached_tokens
            if first.prompt_logprobs is not None:  # one prompt: its scores, and how far a prefix hit may reach
                fork.prompt_logprobs = list(first.prompt_logprobs)  # over them, are every choice's (scoring/)
                fork.max_cached_tokens = first.max_cached_tokens
            batcher.start_running(fork)
            self.num_forks += 1

    def discard(self, first: Sequence) -> None:
        """A request dropped before its prompt ended: its forks never start."""
        self.held.pop(first, None)

