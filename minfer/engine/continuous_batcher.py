"""ContinuousBatcher: the scheduling policy. Which tokens of which sequences run each step, in which KV blocks.

It holds the waiting and running queues and the block allocator's side of every
sequence. Each `schedule()`:
1. schedules the running sequences first, oldest first: one token each for
   decodes, a chunk for prompts still prefilling. If the KV blocks run out, the
   most recently admitted running sequence is preempted: its blocks are freed
   and it goes back to the front of the queue, to be recomputed later;
2. admits waiting requests, first come first served, while there are free
   blocks, free sequence slots (`max_num_seqs`) and token budget left
   (`max_num_batched_tokens`); a long prompt gets a chunk of the budget now and
   the rest in later steps, alongside the running decodes.
After the forward pass, `advance()` counts the computed tokens and has the
allocator register newly filled blocks in the prefix cache, `fork()` starts the
other n - 1 completions of a request on the blocks of the one whose prefill
just ended, and `retire()` frees a finished sequence's blocks at once. The prefix cache's hashes are the
allocator's alone: this class hands it token ids and block tables, never a
hash. What a request's text is, or who asked for it, is the OnlineScheduler's
business (scheduler.py), not this class's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..attention.kv_cache import cdiv
from ..step_parts import part
from .block_allocator import BlockAllocator
from .sequence import ScheduledChunk, Sequence, Status


class ContinuousBatcher:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_logprob_rows: int | None = None,  # prompt positions one step may score (logprobs.py); None: no cap
        propose: Callable[[Sequence, int, int], list[int]] | None = None,  # speculative decoding's proposer
    ):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_logprob_rows = max_logprob_rows or max_num_batched_tokens
        self.propose = propose  # (seq, rows left, running) -> tokens to verify after its last; None: none
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.copies: list[tuple[int, int]] = []  # this step's copy-on-write: (src, dst) blocks, to copy before it runs

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: running sequences first, then newly admitted ones, within the token budget."""
        budget = self.max_num_batched_tokens
        self._logprob_rows_left = self.max_logprob_rows  # prompt positions scored this step
        self.copies = []
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk_size(seq, seq.num_computed_tokens, budget)
            if n == 0:  # its prompt logprobs wait for the next step's rows
                i += 1
                continue
            draft = []
            if self.propose and n == 1:
                with part("speculation: propose"):
                    draft = self.propose(seq, budget - n, len(self.running))
            if not self._grow(seq, seq.num_computed_tokens + n + len(draft)):
                preempted = True
                if seq not in self.running:  # it was itself the newest: nothing left to schedule
                    break
                continue  # a newer sequence gave up its blocks; try this one again
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n + len(draft), draft))
            self._take_logprob_rows(seq, n)
            budget -= n + len(draft)
            i += 1
        # Admitting right after a preemption would just take the blocks back. A sequence with forks still
        # to come takes their slots too.
        slots = sum(1 + len(s.forks) for s in self.running)
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            if slots + 1 + len(seq.forks) > self.max_num_seqs:
                break
            chunk = self._admit(seq, budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(chunk)
            self._take_logprob_rows(seq, chunk.num_tokens)
            budget -= chunk.num_tokens
            slots += 1 + len(seq.forks)
        return chunks

    def fork(self, parent: Sequence) -> list[Sequence]:
        """The parent's prefill has just run and sampled a token for each of its forks: start them. Each
        shares every block of the parent's (one more reference each, no copy): the full prompt blocks for
        good, the last partial one until someone writes to it (_grow copies it then)."""
        forks, parent.forks = parent.forks, []
        for seq in forks:
            seq.block_table = list(parent.block_table)
            self.allocator.share(seq.block_table)
            seq.num_computed_tokens = parent.num_computed_tokens
            seq.num_cached_tokens = parent.num_cached_tokens
            seq.prompt_logprobs = list(parent.prompt_logprobs)  # each choice echoes the one prompt
            seq.status = Status.RUNNING
            self.running.append(seq)
        return forks

    def advance(self, chunks: list[ScheduledChunk]) -> None:
        """The chunks' K/V are now in the cache: count them, and make newly full blocks findable."""
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens - len(chunk.draft)  # proposals count once kept
            self.allocator.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)

    def keep_proposals(self, seq: Sequence, num_kept: int) -> None:
        """Speculative decoding's rollback, once a verification's tokens are appended to seq: the K/V of
        the first num_kept proposals (those now in its tokens) stay, the rejected ones' slots are
        written over by the next step, and blocks that held only rejected proposals go back. Only
        computed tokens are ever registered, so no cached block holds a rejected one."""
        seq.num_computed_tokens += num_kept
        self.allocator.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        needed = cdiv(seq.num_tokens, self.block_size)  # the next step writes the last token
        if len(seq.block_table) > needed:
            self.allocator.free(seq.block_table[needed:])
            del seq.block_table[needed:]

    def retire(self, seq: Sequence) -> None:
        """A running sequence finished: free its blocks now."""
        self.running.remove(seq)
        self._free_blocks(seq)

    def discard(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is, freeing its blocks (a fork not yet started holds none)."""
        if seq.status is Status.RUNNING:
            self.retire(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give seq blocks for num_tokens tokens; if short, preempt the newest running sequence.

        Copy-on-write: if the block the step's first token goes into is shared (a fork's last prompt block,
        partly full), seq gets its own copy of it first; the last holder writes in place."""
        table = seq.block_table
        first = seq.num_computed_tokens // self.block_size  # the block the first new token is written to
        copy = first < len(table) and self.allocator.is_shared(table[first])
        need = max(cdiv(num_tokens, self.block_size) - len(table), 0)
        if need + copy <= self.allocator.num_free_blocks:
            if copy:
                (own,) = self.allocator.allocate(1)
                self.copies.append((table[first], own))
                self.allocator.free([table[first]])  # one reference fewer: the others keep it
                table[first] = own
            table += self.allocator.allocate(need)
            return True
        self._preempt(self.running[-1])
        return False

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """Reuse the longest cached prefix (always leaving one token to compute), give blocks for the
        first chunk, or return None if the blocks are not there."""
        hits = self.allocator.match_prefix(seq.token_ids[: seq.num_tokens - 1])
        if seq.params.prompt_logprobs is not None:  # a hit must not skip positions still to be scored
            hits = hits[: len(seq.prompt_logprobs) // self.block_size]
        cached = len(hits) * self.block_size
        n = self._chunk_size(seq, cached, budget)
        if n == 0:
            return None
        new_blocks = cdiv(cached + n, self.block_size) - len(hits)
        if new_blocks + self.allocator.num_unreferenced(hits) > self.allocator.num_free_blocks:
            return None
        self.allocator.share(hits)
        seq.block_table = hits + self.allocator.allocate(new_blocks)
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        self.prefix_cache_hit_tokens += cached
        seq.status = Status.RUNNING
        return ScheduledChunk(seq, cached, n)

    def _chunk_size(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens of seq to compute from `start` this step: the rest, within the token budget and, while
        its prompt logprobs are being scored, within the rows left for them."""
        n = min(seq.num_tokens - start, budget)
        return min(n, self._logprob_rows_left) if seq.num_prompt_logprobs_missing > 0 else n

    def _take_logprob_rows(self, seq: Sequence, n: int) -> None:
        if seq.num_prompt_logprobs_missing > 0:
            self._logprob_rows_left -= n

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
