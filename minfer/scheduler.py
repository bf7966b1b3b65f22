"""OnlineScheduler: continuous batching over a paged KV cache, with chunked prefill and preemption.

Every call to `step()`:
1. schedules the running sequences first, oldest first: one token each for
   decodes, a chunk for prompts still prefilling. If the KV blocks run out, the
   most recently admitted running sequence is preempted: its blocks are freed
   and it goes back to the front of the queue, to be recomputed later;
2. admits waiting requests, first come first served, while there are free
   blocks, free sequence slots (`max_num_seqs`) and token budget left
   (`max_num_batched_tokens`); a long prompt gets a chunk of the budget now and
   the rest in later steps, alongside the running decodes;
3. runs all of it as one forward pass, then records the sampled tokens,
   registers newly filled blocks in the prefix cache, and retires finished
   requests, freeing their blocks at once.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from .errors import InvalidParameter
from .kv_cache import BlockAllocator, KVCache, choose_num_blocks
from .model_runner import ModelRunner, ScheduledChunk
from .sampling import SamplingParams, make_generator
from .sequence import RequestOutput, Sequence, Status
from .step_parts import part
from .tokenizer import Tokenizer


class OnlineScheduler:
    def __init__(
        self,
        model: torch.nn.Module,  # any of models.ARCHITECTURES
        tokenizer: Tokenizer,
        *,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        kv_cache_memory: int | None = None,
        kv_cache_fraction: float | None = None,
    ):
        for name, value in [
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        if num_kv_blocks is None:
            num_kv_blocks = choose_num_blocks(
                model.config, block_size, model.dtype, model.device, max_num_seqs, kv_cache_memory, kv_cache_fraction
            )
        self.allocator = BlockAllocator(num_kv_blocks, block_size, enable_prefix_caching)
        self.kv_cache = KVCache(model.config, num_kv_blocks, block_size, model.device, model.dtype)
        self.runner = ModelRunner(model, self.kv_cache, block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.requests: dict[str, Sequence] = {}  # every request not yet popped or discarded
        self.finished_ids: list[str] = []  # finished since the last pop_finished_ids()
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.num_steps = 0
        self.last_step: dict = {}
        self.last_chunks: list[ScheduledChunk] = []  # what the last step ran, for the engine event feed

    # ---- public API ------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + max_tokens) add_request can accept."""
        return min(self.config.max_positions, self.allocator.num_blocks * self.block_size)

    def add_request(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; token ids skip tokenization. Refuses what could never run."""
        params = sampling_params or SamplingParams()
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidParameter(
                    "prompt", f"prompt must be a string, got {type(prompt).__name__}", "invalid_type"
                )
            prompt_token_ids = self.tokenizer.encode_prompt(prompt)
        ids = self.check_request(prompt_token_ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(
            request_id,
            ids,
            params,
            self.tokenizer.detokenizer(),
            self.tokenizer.eos_token_ids,
            make_generator(params.seed, self.model.device),
        )
        self.requests[request_id] = seq
        self.waiting.append(seq)
        return request_id

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, if a request with it could ever run; else InvalidParameter naming the
        field at fault. It reads only fixed limits, so any thread may call it (the server does, before
        handing the request to the engine thread)."""
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty: it must have at least one token")
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter("prompt", f"prompt token id {bad!r} is not in the vocabulary [0, {vocab})")
        context = self.config.max_positions
        if len(ids) + params.max_tokens > context:
            raise InvalidParameter(
                "max_tokens" if len(ids) < context else "prompt",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {context} tokens",
                "context_length_exceeded",
            )
        blocks = -(-(len(ids) + params.max_tokens) // self.block_size)
        if blocks > self.allocator.num_blocks:
            raise InvalidParameter(
                "max_tokens",
                f"the request needs {blocks} KV blocks but the cache has only {self.allocator.num_blocks}",
                "context_length_exceeded",
            )
        return ids

    def step(self) -> dict[str, int]:
        """Run one engine step. Returns {request_id: token_id} for every token sampled."""
        start = time.perf_counter()
        preemptions_before = self.num_preemptions
        with part("host: schedule"):
            chunks = self._schedule()
        if not chunks:
            return {}
        tokens = self.runner.execute(chunks)
        with part("host: bookkeeping"):
            return self._finish_step(chunks, tokens, start, preemptions_before)

    def _finish_step(self, chunks: list[ScheduledChunk], tokens: list[int], start: float, preemptions_before: int):
        now = time.perf_counter()
        self.num_steps += 1
        self.last_chunks = chunks
        decode_tokens = sum(1 for c in chunks if c.num_tokens == 1 and c.start >= c.seq.num_prompt_tokens)
        self.last_step = {  # what this step did, for benchmarks and traces
            "start": start,
            "end": now,
            "num_seqs": len(chunks),
            "num_decode_tokens": decode_tokens,
            "num_prefill_tokens": sum(c.num_tokens for c in chunks) - decode_tokens,
            "num_sampled": len(tokens),
            # Attention work: queries x the context each attends to, and context read from the cache.
            "attended_pairs": sum(c.num_tokens * (c.start + c.num_tokens) for c in chunks),
            "cached_context_tokens": sum(c.start + c.num_tokens for c in chunks if c.start > 0),
            "num_preemptions": self.num_preemptions - preemptions_before,
            "kv_blocks_used": self.allocator.num_blocks - self.allocator.num_free_blocks,
        }
        out = {}
        sampled = iter(tokens)
        for chunk in chunks:
            seq = chunk.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
            seq.num_steps += 1
            seq.num_computed_tokens += chunk.num_tokens
            self._register_full_blocks(seq)
            if chunk.samples:
                token = next(sampled)
                seq.append_token(token, now)
                out[seq.request_id] = token
                if seq.is_finished:
                    self._retire(seq)
        return out

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def is_finished(self, request_id: str) -> bool:
        return self._get(request_id).is_finished

    def get_generated_ids(self, request_id: str) -> list[int]:
        return self._get(request_id).output_token_ids  # a fresh list: callers may keep it

    def get_step_count(self, request_id: str) -> int:
        """How many engine steps have run this request (prefill chunks and decodes)."""
        return self._get(request_id).num_steps

    def get_new_text(self, request_id: str) -> str:
        """Text generated since the last call, minus a tail that might still turn into a stop string."""
        seq = self._get(request_id)
        end = seq.stable_text_length()
        piece = seq.text[seq.num_streamed_chars : end]
        seq.num_streamed_chars = max(seq.num_streamed_chars, end)
        return piece

    def pop_finished_ids(self) -> list[str]:
        """Ids of the requests finished since the last call."""
        finished, self.finished_ids = self.finished_ids, []
        return finished

    def pop_response(self, request_id: str) -> RequestOutput:
        """The finished request's output; the scheduler forgets it."""
        seq = self._get(request_id)
        if not seq.is_finished:
            raise ValueError(f"request {request_id!r} has not finished")
        del self.requests[request_id]
        return seq.to_output()

    def discard_request(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing its KV blocks now. False if it was unknown."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._free_blocks(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        return True

    def stats(self) -> dict:
        return {
            "num_kv_blocks_total": self.allocator.num_blocks,
            "num_kv_blocks_free": self.allocator.num_free_blocks,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "num_steps": self.num_steps,
        }

    # ---- scheduling ------------------------------------------------------------------

    def _schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + n):
                preempted = True
                if seq not in self.running:  # it was itself the newest: nothing left to schedule
                    break
                continue  # a newer sequence gave up its blocks; try this one again
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        # Admitting right after a preemption would just take the blocks back.
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            chunk = self._admit(seq, budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give seq blocks for num_tokens tokens; if short, preempt the newest running sequence."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= self.allocator.num_free_blocks:
            seq.block_table += self.allocator.allocate(max(need, 0))
            return True
        self._preempt(self.running[-1])
        return False

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """Reuse the longest cached prefix (always leaving one token to compute), give blocks for the
        first chunk, or return None if the blocks are not there."""
        hits = self.allocator.match_prefix(seq.token_ids[: seq.num_tokens - 1])
        cached = len(hits) * self.block_size
        n = min(seq.num_tokens - cached, budget)
        new_blocks = -(-(cached + n) // self.block_size) - len(hits)
        if new_blocks + self.allocator.num_unreferenced(hits) > self.allocator.num_free_blocks:
            return None
        self.allocator.share(hits)
        seq.block_table = hits + self.allocator.allocate(new_blocks)
        seq.block_hashes = [self.allocator.blocks[b].hash for b in hits]
        seq.num_computed_tokens = seq.num_cached_tokens = cached
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

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Blocks whose every slot now holds computed K/V become findable by later requests."""
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(self.allocator.register(seq.block_table[i], parent, tokens))

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        self.finished_ids.append(seq.request_id)

    def _free_blocks(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def _get(self, request_id: str) -> Sequence:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}") from None

    def check_invariants(self) -> None:
        """Assert the allocator agrees with the block tables of the running sequences (for tests)."""
        self.allocator.check_invariants([seq.block_table for seq in self.running])
        assert all(not s.block_table for s in self.waiting), "a waiting sequence holds blocks"
