"""OnlineScheduler: the engine's public face. Requests in, one step at a time, tokens and text out.

It owns the request registry (every request not yet popped or discarded), each
request's text stream, the step statistics, and the parts that do the work:
- ContinuousBatcher (continuous_batcher.py), the scheduling policy: waiting and
  running queues, admission under a token budget, chunked prefill, preemption,
  KV block growth, prefix-cache registration;
- ModelRunner (model_runner.py): one scheduled step -> one forward pass -> one
  sampled token per sequence that reached its last token.

Every call to `step()` asks the batcher for this step's chunks, runs them as one
forward pass, lets the batcher count the computed tokens, and then records each
sampled token: in its sequence (stop tokens, max_tokens), in its text stream
(stop strings) and in its request's timeline; a finished request's blocks are
freed at once.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Iterator

import torch

from ..attention.kv_cache import KVCache, cdiv, choose_num_blocks
from ..cpu.thread_share import CpuShare, threads_chosen
from ..errors import InvalidParameter, is_int
from ..quantization import quantization_of
from ..step_parts import part
from ..text.text_stream import TextStream
from ..text.tokenizer import Tokenizer
from .block_allocator import BlockAllocator
from .config import EngineConfig, dtype_name
from .continuous_batcher import ContinuousBatcher
from ..compiled.cuda_graphs import decode_graphs_for
from ..scoring.logprobs import keep_top, max_logprob_rows
from .model_runner import ModelRunner, StepOutput
from ..assembly.prepare import prepare_model
from .request_state import Choice, Request
from .sampling import SamplingParams, make_generator
from .sequence import CompletionDelta, RequestOutput, ScheduledChunk, Sequence, Status
from ..speculative import Speculator
from ..speculative.draft import DraftProposer, load_draft_model
from .step_stats import StepStats


class OnlineScheduler:
    def __init__(
        self,
        model: torch.nn.Module,  # any of models.ARCHITECTURES, loaded as the caller chose
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        **settings,  # EngineConfig's fields (block_size=, num_kv_blocks=, ...), over `config`
    ):
        config = replace(config or EngineConfig(), **settings)
        if config.max_model_len is not None and config.max_model_len > model.config.max_positions:
            raise ValueError(
                f"--max-model-len {config.max_model_len} exceeds the model's context of "
                f"{model.config.max_positions} tokens"
            )
        torch.manual_seed(config.seed)  # requests without a seed sample from the global RNG
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.block_size = block_size = config.block_size
        self.context_len = config.max_model_len or model.config.max_positions
        draft = load_draft_model(config, model, self.context_len) if config.speculative_method == "draft" else None
        num_kv_blocks = config.num_kv_blocks or choose_num_blocks(
            model.config,
            block_size,
            model.dtype,
            model.device,
            config.max_num_seqs,
            config.kv_cache_memory,
            config.gpu_memory_utilization,
            self.context_len,
            DraftProposer.bytes_per_block(draft, block_size) if draft else 0,  # its cache is on the same blocks
        )
        self.allocator = BlockAllocator(num_kv_blocks, block_size, config.enable_prefix_caching)
        model, attention_backend = prepare_model(model, config)  # once, before the first step; idempotent
        # the cache is laid out as the attention backend reads it
        self.kv_cache = KVCache.for_backend(
            model.config, num_kv_blocks, block_size, model.device, model.dtype, attention_backend
        )
        self.speculator = None  # speculative decoding (speculative/), when asked for
        self.draft = draft and DraftProposer(draft, num_kv_blocks, block_size, config, model.config)
        if config.speculative_method is not None:
            k = config.num_speculative_tokens
            self.speculator = Speculator(k, config.ngram_min, config.ngram_max, self.draft)
        self.batcher = ContinuousBatcher(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_logprob_rows(model.config.vocab_size),
            self.speculator.propose if self.speculator else None,
        )
        longest = min(self.context_len, num_kv_blocks * block_size)
        self.runner = ModelRunner(
            model, self.kv_cache, block_size, attention_backend, self.draft,
            config.compile_decode_step or config.compile_model, whole_graph=config.compile_model,
            decode_graphs=decode_graphs_for(model, attention_backend, self.kv_cache, config, longest),
        )
        self.cpu_share = CpuShare(enabled=model.device.type == "cpu" and not threads_chosen(config.num_threads))
        self.runner.warm_up()  # the compiled decode step's graphs, if asked for: before any request waits on them
        # What runs, every choice made: the dtype "auto" picked, the blocks the memory bought, the
        # longest request the cache holds, the attention that runs. The server's /health reports it.
        self.engine_config = replace(
            config,
            attention_backend="compiled" if attention_backend.name in ("compiled", "flex") else "eager",
            compile_decode_step=config.compile_decode_step and self.runner.compiles_decode_steps,  # False if its
            compile_model=config.compile_model and self.runner.compiles_decode_steps,  # warm-up failed
            device=str(model.device),
            dtype=dtype_name(model.dtype),
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=None,
            gpu_memory_utilization=None,
            max_model_len=longest,
            quantization=quantization_of(model),  # a quantized checkpoint is quantized without the flag
        )
        self.requests: dict[str, Request] = {}  # every request not yet popped or discarded
        self.finished_ids: list[str] = []  # finished since the last pop_finished_ids()
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_step: StepStats | None = None
        self.last_chunks: list[ScheduledChunk] = []  # what the last step ran, for the engine event feed

    # ---- the batcher's state, read-only for callers ----------------------------------

    @property
    def waiting(self):
        return self.batcher.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.batcher.running

    @property
    def max_num_seqs(self) -> int:
        return self.batcher.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.batcher.max_num_batched_tokens

    @property
    def num_preemptions(self) -> int:
        return self.batcher.num_preemptions

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.batcher.prefix_cache_hit_tokens

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + max_tokens) add_request can accept."""
        return self.engine_config.max_model_len

    # ---- requests in -----------------------------------------------------------------

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
        choices = [self._choice(request_id, ids, params, i) for i in range(params.n)]
        choices[0].seq.forks = [c.seq for c in choices[1:]]  # they start when its prefill ends
        self.requests[request_id] = Request(choices, arrival_time=time.perf_counter())
        self.batcher.add(choices[0].seq)
        return request_id

    def _choice(self, request_id: str, ids: list[int], params: SamplingParams, index: int) -> Choice:
        """Completion `index` of a request. With a seed, its own generator seeded seed + index (as vLLM
        does): reproducible, and the same whatever else runs."""
        seed = None if params.seed is None else params.seed + index
        generator = make_generator(seed, self.model.device)
        seq = Sequence(request_id, ids, params, self.tokenizer.eos_token_ids, generator, index)
        detokenizer = self.tokenizer.detokenizer(params.skip_special_tokens)
        return Choice(seq, TextStream(detokenizer, params.stop, params.include_stop_str_in_output))

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, if a request with it could ever run; else InvalidParameter naming the
        field at fault. It reads only fixed limits, so any thread may call it (the server does, before
        handing the request to the engine thread)."""
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidParameter("prompt", "the prompt is empty: it must have at least one token")
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not is_int(t) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter("prompt", f"prompt token id {bad!r} is not in the vocabulary [0, {vocab})")
        if params.n > self.max_num_seqs:
            raise InvalidParameter(
                "n", f"n = {params.n} is more completions than this engine runs at once (max_num_seqs {self.max_num_seqs})"
            )
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise InvalidParameter("logit_bias", f"logit_bias token id {bad} is not in the vocabulary [0, {vocab})")
        context = self.context_len  # the model's, or --max-model-len
        if len(ids) + params.max_tokens > context:
            raise InvalidParameter(
                "max_tokens" if len(ids) < context else "prompt",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {context} tokens",
                "context_length_exceeded",
            )
        blocks = cdiv(len(ids) + params.max_tokens, self.block_size)
        if blocks > self.allocator.num_blocks:
            raise InvalidParameter(
                "max_tokens",
                f"the request needs {blocks} KV blocks but the cache has only {self.allocator.num_blocks}",
                "context_length_exceeded",
            )
        return ids

    # ---- stepping --------------------------------------------------------------------

    def step(self) -> dict[str, int]:
        """Run one engine step. Returns {request_id: token_id} for every token sampled."""
        start = time.perf_counter()
        self.cpu_share.update()  # fewer threads while other processes take cores (cpu_share.py)
        preemptions_before = self.num_preemptions
        with part("host: schedule"):
            chunks = self.batcher.schedule()
        if not chunks:
            return {}
        for cache in (self.kv_cache, self.draft.kv_cache) if self.draft else (self.kv_cache,):
            cache.copy_blocks(self.batcher.copies, self.block_size)  # copy-on-write, before anyone writes
        output = self.runner.execute(chunks)
        with part("host: bookkeeping"):
            end = time.perf_counter()
            self._record_step(chunks, start, end, self.num_preemptions - preemptions_before)
            self._record_prompt_logprobs(chunks, output)  # before advance(): it may register their blocks
            self.batcher.advance(chunks)
            return self._record_tokens(chunks, output, end)

    def steps(self) -> Iterator[dict[str, int]]:
        """Step until every request has finished, yielding each step's {request_id: token_id}.
        Requests added between steps join the batch: the loop runs until none is left."""
        while self.has_unfinished():
            yield self.step()

    def _record_prompt_logprobs(self, chunks: list[ScheduledChunk], output: StepOutput) -> None:
        for i, entries in output.prompt_logprobs.items():
            seq = chunks[i].seq
            seq.prompt_logprobs += [keep_top(e, seq.params.prompt_logprobs) for e in entries]

    def _record_tokens(self, chunks: list[ScheduledChunk], output: StepOutput, now: float) -> dict[str, int]:
        """Give each sampler of each chunk its token and logprobs; forks start first (they share the
        parent's blocks, which the parent may free at once if its first token finishes it)."""
        out = {}
        row = 0  # the sampled row's index in the step, as StepOutput.tokens and sample_logprobs count them
        for i, chunk in enumerate(chunks):
            request = self.requests[chunk.seq.request_id]
            request.num_steps += 1
            samplers = chunk.samplers
            if len(samplers) > 1:
                self.batcher.fork(chunk.seq)
            for seq in samplers:
                # A speculating chunk emits its accepted proposals and one more token, one at a time (a
                # stop or max_tokens among them ends it there); any other sampler emits one token.
                num_emitted = output.num_accepted[i] + 1 if chunk.draft else 1
                for j in range(row, row + num_emitted):
                    token = output.tokens[j]
                    if j in output.sample_logprobs:
                        seq.logprobs.append(keep_top(output.sample_logprobs[j], seq.params.logprobs))
                    finished = request.choices[seq.index].add_token(token, now)
                    out[seq.request_id] = token  # a request with n > 1 appears once, with its last choice's
                    if finished:
                        break
                if chunk.draft:
                    self._keep_proposals(seq, chunk.draft, output.num_accepted[i], num_emitted=j - row + 1)
                row += len(chunk.row_samplers) if chunk.draft else 1
                if finished:
                    self.batcher.retire(seq)
                    if request.is_finished:
                        self.finished_ids.append(seq.request_id)
        return out

    def _keep_proposals(self, seq: Sequence, draft: list[int], num_accepted: int, num_emitted: int) -> None:
        """After a verification that emitted num_emitted tokens (fewer than num_accepted + 1 when a stop
        among them ended the sequence): count it, keep the K/V of the proposals now in seq's tokens,
        give back the rest."""
        self.speculator.record(seq, len(draft), num_accepted)
        self.batcher.keep_proposals(seq, min(num_emitted, num_accepted))
        self.last_step.num_sampled += num_emitted - 1  # the step counted one token per sampler
        self.last_step.num_draft_tokens += len(draft)
        self.last_step.num_accepted_tokens += num_accepted

    def _record_step(self, chunks: list[ScheduledChunk], start: float, end: float, num_preemptions: int) -> None:
        self.num_steps += 1
        self.last_chunks = chunks
        kv_blocks_used = self.allocator.num_blocks - self.allocator.num_free_blocks
        self.last_step = StepStats.of(chunks, start, end, num_preemptions, kv_blocks_used)

    def close(self) -> None:
        """Release what the engine holds beside its tensors (CUDA graphs). Requests still in it stay as they are."""
        self.runner.close()

    def has_unfinished(self) -> bool:
        return self.batcher.has_unfinished()

    # ---- results out -----------------------------------------------------------------

    def is_finished(self, request_id: str) -> bool:
        return self._get(request_id).is_finished

    def get_generated_ids(self, request_id: str) -> list[int]:
        return self._get(request_id).seq.output_token_ids  # a fresh list: callers may keep it

    def get_step_count(self, request_id: str) -> int:
        """How many engine steps have run this request (prefill chunks and decodes)."""
        return self._get(request_id).num_steps

    def get_new_text(self, request_id: str) -> str:
        """Text generated since the last call, minus a tail that might still turn into a stop string."""
        choice = self._get(request_id).choices[0]
        return choice.text.pop_new_text(finished=choice.seq.is_finished)

    def get_new_output(self, request_id: str) -> CompletionDelta:
        """The token ids sampled since the last call, with the text they add: what a server streams for
        the request after a step. For a request with n > 1, get_new_outputs."""
        deltas = self.get_new_outputs(request_id)
        return deltas[0] if deltas else CompletionDelta(0, [], "", self._get(request_id).seq.finish_reason)

    def get_new_outputs(self, request_id: str) -> list[CompletionDelta]:
        """One CompletionDelta per choice that sampled since the last call, in index order."""
        return [d for c in self._get(request_id).choices if (d := c.new_output()) is not None]

    def pop_finished_ids(self) -> list[str]:
        """Ids of the requests finished since the last call."""
        finished, self.finished_ids = self.finished_ids, []
        return finished

    def pop_response(self, request_id: str) -> RequestOutput:
        """The finished request's output; the scheduler forgets it. For n > 1, pop_responses."""
        if len(self._get(request_id).choices) > 1:
            raise ValueError(f"request {request_id!r} has several choices: use pop_responses")
        return self.pop_responses(request_id)[0]

    def pop_responses(self, request_id: str) -> list[RequestOutput]:
        """The finished request's output, one per choice in index order; the scheduler forgets it."""
        request = self._get(request_id)
        if not request.is_finished:
            raise ValueError(f"request {request_id!r} has not finished")
        del self.requests[request_id]
        return [c.output(request_id, request.arrival_time) for c in request.choices]

    def discard_request(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing its KV blocks now (every choice's). False if it was unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for choice in request.choices:
            self.batcher.discard(choice.seq)
            choice.seq.status = Status.FINISHED
            choice.seq.forks = []
        return True

    def stats(self) -> dict:
        spec = self.speculator.stats.as_dict() if self.speculator else {}
        return spec | {
            "num_kv_blocks_total": self.allocator.num_blocks,
            "num_kv_blocks_free": self.allocator.num_free_blocks,
            "num_kv_blocks_shared": self.allocator.num_shared_blocks,  # held by several sequences, stored once
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "num_steps": self.num_steps,
        }

    def _get(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}") from None

    def check_invariants(self) -> None:
        """Assert the allocator agrees with the block tables of the running sequences (for tests)."""
        self.batcher.check_invariants()
