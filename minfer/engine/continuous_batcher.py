"""ContinuousBatcher: the scheduling policy. Which tokens of which sequences run each step, in which KV blocks.

It holds the waiting and running queues and the block allocator's side of every sequence. Each `schedule()`:
1. schedules the running sequences first, oldest first: one token each for decodes, a chunk for prompts still
   prefilling. If the KV blocks run out, the most recently admitted running sequence is preempted: its blocks
   are freed and it goes back to the front of the queue, to be recomputed later;
2. admits waiting requests, first come first served, while there are free blocks, free sequence slots
   (`max_num_seqs`) and token budget left (`max_num_batched_tokens`); a long prompt gets a chunk of the
   budget now and the rest in later steps, alongside the running decodes.
After the forward pass, `advance()` counts the computed tokens and has the allocator register newly full
blocks in the prefix cache (the hashes are the allocator's alone: this class hands it token ids and block
tables), and `retire()` frees a finished sequence's blocks at once. What a request's text is, or who asked
for it, is the OnlineScheduler's business (scheduler.py).
"""

from __future__ import annotations

from collections import deque

from ..attention.kv_cache import cdiv
from .block_allocator import BlockAllocator
from .sequence import ScheduledChunk, Sequence, Status


class ContinuousBatcher:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int, speculation=None):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0  # prompt tokens first admissions found cached
        self.recompute_cache_hit_tokens = 0  # tokens re-admissions of preempted sequences found cached
        self.speculation = speculation  # speculative/: a decode may verify proposals in the same step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: running sequences first, then newly admitted ones, within the token budget."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if self.speculation is not None:  # speculative/speculation.py: a decode that proposes tokens
                chunk = self.speculation.propose(chunk, budget, len(self.running))
            if not self.grow(seq, chunk.start + chunk.num_rows):
                preempted = True
                if seq not in self.running:  # it was itself the newest: nothing left to schedule
                    break
                continue  # a newer sequence gave up its blocks; try this one again
            chunks.append(chunk)
            budget -= chunk.num_rows
            i += 1
        # Admitting right after a preemption would just take the blocks back.
        seats = sum(s.seats for s in self.running)
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            chunk = self._admit(seq, budget) if seats + seq.seats <= self.max_num_seqs else None
            if chunk is None:  # no seat left for it, or not the blocks
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(chunk)
            budget -= chunk.num_tokens
            seats += seq.seats
        return chunks

    def advance(self, chunks: list[ScheduledChunk]) -> None:
        """The chunks' K/V are now in the cache: count them, and make newly full blocks findable."""
        for chunk in chunks:
            self.computed(chunk.seq, chunk.num_tokens)

    def computed(self, seq: Sequence, num_tokens: int) -> None:
        """num_tokens more of seq's tokens have their K/V in the cache: count them, register full blocks."""
        seq.num_computed_tokens += num_tokens
        self.allocator.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)

    def start_running(self, seq: Sequence) -> None:
        """A sequence that already holds blocks (one that starts from another's) joins the running ones."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def retire(self, seq: Sequence) -> None:
        """A running sequence finished: free its blocks now."""
        self.running.remove(seq)
        self._free_blocks(seq)

    def discard(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is, freeing its blocks. Where it is, not its status, decides: a step that
        failed may have finished it (its last token recorded) before retiring it."""
        if seq in self.running:
            self.retire(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give seq blocks for num_tokens tokens; if short, preempt the newest running sequence."""
        need = max(cdiv(num_tokens, self.block_size) - len(seq.block_table), 0)
        if need <= self.allocator.num_free_blocks:
            seq.block_table += self.allocator.allocate(need)
            return True
        self._preempt(self.running[-1])
        return False

    def shrink(self, seq: Sequence) -> None:
        """Give back the blocks past those seq's tokens need (the next step writes its last token)."""
        needed = cdiv(seq.num_tokens, self.block_size)
        if len(seq.block_table) > needed:
            self.allocator.free(seq.block_table[needed:])
            del seq.block_table[needed:]

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """Reuse the longest cached prefix (always leaving one token to compute), give blocks for the
        first chunk, or return None if the blocks are not there."""
        hits = self.allocator.match_prefix(seq.token_ids[: seq.num_tokens - 1])
        if seq.max_cached_tokens is not None:
            hits = hits[: seq.max_cached_tokens // self.block_size]
        cached = len(hits) * self.block_size
        n = min(seq.num_tokens - cached, budget)
        new_blocks = cdiv(cached + n, self.block_size) - len(hits)
        if new_blocks + self.allocator.num_unreferenced(hits) > self.allocator.num_free_blocks:
            return None
        self.allocator.share(hits)
        seq.block_table = hits + self.allocator.allocate(new_blocks)
        seq.num_computed_tokens = cached
        if seq.num_preemptions:  # a recompute: it finds its own blocks, generated tokens too, not just its prompt's
            seq.num_recompute_cached_tokens += cached
            self.recompute_cache_hit_tokens += cached
        else:
            seq.num_cached_tokens = cached
            self.prefix_cache_hit_tokens += cached
        seq.status = Status.RUNNING
        return ScheduledChunk(seq, cached, n)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it waits at the front and is recomputed later."""
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def check_invariants(self) -> None:
        """Assert the allocator agrees with the block tables of the running sequences (for tests)."""
        self.allocator.check_invariants([seq.block_table for seq in self.running])
        assert all(not s.block_table for s in self.waiting), "a waiting sequence holds blocks"
