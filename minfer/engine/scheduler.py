"""OnlineScheduler: the engine's public face. Requests in, one step at a time, tokens and text out.

It owns the request registry (every request not yet popped or discarded) and each request's text
stream, and hands the work to ContinuousBatcher (continuous_batcher.py: which tokens of which
sequences run, in which KV blocks) and ModelRunner (model_runner.py: one forward pass, one sampled
token per sequence that reached its last token). A step's tokens then go to their sequences (stop
tokens, max_tokens), text streams (stop strings) and timelines; a finished request's blocks are
freed at once.

Features (logprobs, n > 1 on shared blocks, speculative decoding, structured outputs, compiled steps,
CPU thread sharing) live in rooms of their own and act at the lines of `step()` and `add_request()` that
name them. This class builds none of them: `minfer.assembly.build_engine` does, and hands them in.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Iterator

import torch

from ..attention.cache_budget import check_max_model_len, check_num_blocks, choose_num_blocks
from ..attention.backend import AttentionBackend
from ..attention.torch_sdpa import TorchBackend
from ..errors import InvalidParameter
from ..step_parts import part
from ..text.text_stream import TextStream
from ..text.tokenizer import Tokenizer, is_text
from .block_allocator import BlockAllocator
from .config import EngineConfig, dtype_name
from .continuous_batcher import ContinuousBatcher
from .features import BUILDER, Features
from .model_runner import ModelRunner
from .request_check import CheckedRequest, RequestLimits, check_limits
from .request_state import Choice, Request
from .sampling import make_generator
from .sampling_params import SamplingParams
from .outputs import CompletionDelta, RequestOutput
from .sequence import ScheduledChunk, Sequence, Status
from .step_stats import StepStats


class OnlineScheduler:
    def __init__(
        self,
        model: torch.nn.Module,  # any of models.ARCHITECTURES, loaded (and prepared) as the caller chose
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        attention: AttentionBackend | None = None,  # default: the plain backend (attention/torch_sdpa.py)
        features: Features | None = None,  # the feature rooms this engine runs with (assembly.build_engine)
        **settings,  # EngineConfig's fields (block_size=, num_kv_blocks=, ...), over `config`
    ):
        config = replace(config or EngineConfig(), **settings)
        self.features = features = features or Features()
        features.check(config)  # a config asking for a feature this engine was built without: ValueError
        check_max_model_len(model.config, config.max_model_len)
        torch.manual_seed(config.seed)  # requests without a seed sample from the global RNG
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.block_size = block_size = config.block_size
        self.context_len = config.max_model_len or model.config.max_positions
        num_kv_blocks = config.num_kv_blocks or choose_num_blocks(
            model.config, block_size, model.dtype, model.device, config.max_num_seqs,
            config.kv_cache_memory, config.gpu_memory_utilization, self.context_len,
        )
        if config.num_kv_blocks is not None:  # as given: one sentence if it cannot be, before it is built
            check_num_blocks(model.config, block_size, model.dtype, model.device, num_kv_blocks)
        self.allocator = BlockAllocator(num_kv_blocks, block_size, config.enable_prefix_caching)
        self.attention = attention or TorchBackend(model.device, model.dtype)
        self.kv_cache = self.attention.new_cache(model.config, num_kv_blocks, block_size, model.device, model.dtype)
        self.batcher = ContinuousBatcher(
            self.allocator, config.max_num_seqs, config.max_num_batched_tokens, features.speculation
        )
        self.runner = ModelRunner(
            model, self.kv_cache, block_size, self.attention, features.scoring, features.speculation, features.compiled,
            features.structured,
        )
        self.runner.warm_up()  # compiled/: graphs compiled or captured before any request waits on them
        # What runs, every choice made: the dtype "auto" picked, the blocks the memory bought, the
        # longest request the cache holds. The server's /health reports it.
        self.engine_config = replace(
            config,
            device=str(model.device),
            dtype=dtype_name(model.dtype),
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=None,
            gpu_memory_utilization=None,
            max_model_len=min(self.context_len, num_kv_blocks * block_size),
            **features.running(),  # what the features run as: the attention, a compiled step whose warm-up failed
        )
        self.limits = RequestLimits(model.config.vocab_size, config.max_num_seqs, self.context_len, block_size,
                                    num_kv_blocks)
        self.requests: dict[str, Request] = {}  # every request not yet popped or discarded
        self.finished_ids: list[str] = []  # finished since the last pop_finished_ids()
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_chunks: list[ScheduledChunk] = []  # what the last step ran, for the engine event feed
        self._last_step: StepStats | None = None
        self._step_figures: tuple = ()  # what the last step's StepStats are figured from, besides its chunks

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
    def recompute_cache_hit_tokens(self) -> int:
        return self.batcher.recompute_cache_hit_tokens

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + max_tokens) add_request can accept."""
        return self.engine_config.max_model_len

    # ---- requests in -----------------------------------------------------------------

    def add_request(self, prompt: str | CheckedRequest | None = None, *, prompt_token_ids: list[int] | None = None,
                    sampling_params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request: a prompt's text, its token ids, or a CheckedRequest (check_request's verdict, which
        is not checked again). Refuses what could never run. `arrival_time` (time.perf_counter()) is when the
        caller received it, if earlier than now: its latencies count from then."""
        if not isinstance(prompt, CheckedRequest):
            prompt = self._checked(prompt, prompt_token_ids, sampling_params or SamplingParams())
        ids, params = prompt.prompt_token_ids, prompt.params
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        choices = [self._choice(request_id, ids, params, i) for i in range(params.n)]
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.requests[request_id] = Request(choices, arrival_time=arrival_time)
        seqs, features = [c.seq for c in choices], self.features
        if params.wants_logprobs:  # scoring/: the request's sequences keep their logprobs
            features.scoring.add(seqs)
        if params.structured_outputs is not None:  # structured/: each sequence holds a matcher of its grammar
            features.structured.add(seqs)
        if len(seqs) > 1 and features.forks is not None:  # parallel_sampling/: the others start from the first's prompt
            seqs = features.forks.hold(seqs)
        for seq in seqs:
            self.batcher.add(seq)
        return request_id

    def _checked(self, prompt: str | None, prompt_token_ids: list[int] | None,
                 params: SamplingParams) -> CheckedRequest:
        """A request given as text or token ids, checked."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidParameter("prompt", f"prompt must be a string, got {type(prompt).__name__}",
                                       "invalid_type")
            if not is_text(prompt):  # else the tokenizer's TypeError, for a str
                raise InvalidParameter("prompt", "the prompt holds a lone UTF-16 surrogate (U+D800-U+DFFF not in a "
                                       "pair): it is not text")
            prompt_token_ids = self.tokenizer.encode_prompt(prompt)
        return self.check_request(prompt_token_ids, params)

    def _choice(self, request_id: str, ids: list[int], params: SamplingParams, index: int) -> Choice:
        """Completion `index` of a request; with a seed, its own generator seeded seed + index (as vLLM does)."""
        seed = None if params.seed is None else params.seed + index
        generator = make_generator(seed, self.runner.device)
        seq = Sequence(request_id, ids, params, self.tokenizer.eos_token_ids, generator, index)
        detokenizer = self.tokenizer.detokenizer(params.skip_special_tokens, context=ids)  # text after the prompt
        return Choice(seq, TextStream(detokenizer, params.stop, params.include_stop_str_in_output))

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """The request, checked, if it could ever run; else InvalidParameter naming the field at fault. Any
        thread may call it: it reads only fixed limits (request_check.py)."""
        if params.wants_logprobs and self.features.scoring is None:  # never accepted and then not applied
            raise ValueError(f"logprobs need an engine built by {BUILDER}, which attaches scoring/")
        if params.structured_outputs is not None:  # structured/: the grammar compiles, or InvalidParameter
            if self.features.structured is None:
                raise ValueError(f"structured outputs need an engine built by {BUILDER}, which attaches structured/")
            self.features.structured.check(params)
        return check_limits(prompt_token_ids, params, self.limits)

    # ---- stepping --------------------------------------------------------------------

    def step(self) -> dict[str, int]:
        """Run one engine step. Returns {request_id: token_id} for every token sampled."""
        features, start = self.features, time.perf_counter()
        if features.threads is not None:  # cpu/thread_share.py: as many threads as cores others leave free
            features.threads.update()
        preemptions_before = self.batcher.num_preemptions
        with part("host: schedule"):
            chunks = self.batcher.schedule()
            if features.scoring is not None and features.scoring.live:  # scoring/: a bounded number of
                chunks = features.scoring.cap_rows(chunks)  # prompt positions scored a step
            if features.forks is not None and features.forks.held:  # parallel_sampling/: a prompt's last row
                features.forks.add_samplers(chunks)  # draws for its forks too
            if features.speculation is not None:  # speculative/: a draft model fills the step's proposals
                features.speculation.fill(chunks)
        if not chunks:
            return {}
        drawn = self.runner.execute(chunks)  # one forward, one sample, one host sync: a token per sampled row
        with part("host: bookkeeping"):
            end = time.perf_counter()
            self._record_step(chunks, start, end, self.batcher.num_preemptions - preemptions_before)
            self.batcher.advance(chunks)  # count the computed tokens, register newly full blocks
            if features.forks is not None and features.forks.held:  # parallel_sampling/: forks start
                features.forks.start(chunks, self.batcher, self.kv_cache)  # on the prompt's blocks
            sampled = self._record_tokens(chunks, drawn, end)
            if features.structured is not None and features.structured.live:  # structured/: matchers take the
                for seq, reason in features.structured.advance(chunks):  # tokens; a completed grammar ends
                    self._end(seq, reason, end)
            if features.scoring is not None and features.scoring.last is not None:  # scoring/: each sampler
                features.scoring.record(chunks)  # keeps its tokens' logprobs
            if features.speculation is not None:  # speculative/: keep what was accepted, give back the rest
                features.speculation.settle(chunks, self.batcher, self.last_step)
            return sampled

    def steps(self) -> Iterator[dict[str, int]]:
        """Step until every request has finished, yielding each step's {request_id: token_id}.
        Requests added between steps join the batch: the loop runs until none is left."""
        while self.has_unfinished():
            yield self.step()

    def _record_tokens(self, chunks: list[ScheduledChunk], drawn: list[int], now: float) -> dict[str, int]:
        """Give each sampler of each chunk the token(s) it drew: into its sequence, text and timeline."""
        out, row, structured = {}, 0, self.features.structured
        for chunk in chunks:
            request = self.requests[chunk.seq.request_id]
            request.num_steps += 1
            num_sampled = len(chunk.sampled_rows())
            for seq, tokens in chunk.emitted(drawn[row : row + num_sampled]):
                if len(tokens) > 1 and structured is not None and structured.live:  # structured/: a verification's
                    tokens = structured.until_complete(seq, tokens)  # tokens end where they complete the grammar
                for token in tokens:  # a stop or max_tokens among several ends the sequence there
                    finished = request.choices[seq.index].add_token(token, now)
                    out[seq.request_id] = token  # a request with n > 1 appears once, with its last choice's
                    if finished:
                        self.batcher.retire(seq)
                        if request.is_finished:
                            self.finished_ids.append(seq.request_id)
                        break
            row += num_sampled
        return out

    def _end(self, seq: Sequence, reason: str, now: float) -> None:
        """End a sequence by a feature's verdict (structured/: its grammar completed, or allows no token):
        a running one stops here, freeing its blocks; one that has just finished takes the reason."""
        request = self.requests[seq.request_id]
        running = not seq.is_finished
        request.choices[seq.index].end(reason, now)
        if running:
            self.batcher.retire(seq)
            if request.is_finished:
                self.finished_ids.append(seq.request_id)

    def _record_step(self, chunks: list[ScheduledChunk], start: float, end: float, num_preemptions: int) -> None:
        self.num_steps += 1
        self.last_chunks = chunks
        self._last_step = None
        kv_blocks_used = self.allocator.num_blocks - self.allocator.num_free_blocks  # before any block is freed
        self._step_figures = (start, end, num_preemptions, kv_blocks_used)

    @property
    def last_step(self) -> StepStats | None:
        """What the last step did (step_stats.py), figured when first asked: a step nobody reads pays nothing."""
        if self._last_step is None and self.num_steps:
            self._last_step = StepStats.of(self.last_chunks, *self._step_figures)
        return self._last_step

    def close(self) -> None:
        """Release what the engine holds beside its tensors (compiled/: CUDA graphs). Requests stay as they are."""
        if self.features.compiled is not None:
            self.features.compiled.close()

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

    def get_new_output(self, request_id: str) -> CompletionDelta:
        """get_new_outputs' first choice, or an empty delta: what a request with n = 1 streamed since the last call."""
        deltas = self.get_new_outputs(request_id)
        return deltas[0] if deltas else CompletionDelta(0, [], "", self._get(request_id).seq.finish_reason)

    def get_new_outputs(self, request_id: str) -> list[CompletionDelta]:
        """One CompletionDelta per choice that sampled since the last call, in index order: the token ids
        and the text they add. What a server streams for the request after a step."""
        return [d for c in self._get(request_id).choices if (d := c.new_output()) is not None]

    def pop_finished_ids(self) -> list[str]:
        """Ids of the requests finished since the last call."""
        finished, self.finished_ids = self.finished_ids, []
        return finished

    def pop_response(self, request_id: str) -> RequestOutput:
        """pop_responses for a request with one choice."""
        (out,) = self.pop_responses(request_id)
        return out

    def pop_responses(self, request_id: str) -> list[RequestOutput]:
        """The finished request's output, one per choice in index order; the scheduler forgets it."""
        request = self._get(request_id)
        if not request.is_finished:
            raise ValueError(f"request {request_id!r} has not finished")
        del self.requests[request_id]
        return [c.output(request_id, request.arrival_time) for c in request.choices]

    def discard_request(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing its KV blocks now (every choice's); pop_finished_ids never names
        it. False if it was unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.is_finished and request_id in self.finished_ids:  # the caller can no longer pop it
            self.finished_ids.remove(request_id)
        for choice in request.choices:
            self.batcher.discard(choice.seq)
            choice.seq.status = Status.FINISHED
            choice.let_go()
        if self.features.forks is not None and self.features.forks.held:  # parallel_sampling/: forks not
            self.features.forks.discard(request.choices[0].seq)  # yet started are dropped too
        del self.requests[request_id]  # forgotten last: a discard that failed midway can be tried again
        return True

    def stats(self) -> dict:
        speculation, compiled, batcher = self.features.speculation, self.features.compiled, self.batcher
        return (speculation.stats() if speculation is not None else {}) | {  # speculative/: vLLM's spec_decode counters
            **(compiled.stats() if compiled is not None else {}),  # compiled/: paths switched off, what runs now
            "num_kv_blocks_total": self.allocator.num_blocks,
            "num_kv_blocks_free": self.allocator.num_free_blocks,
            "num_kv_blocks_shared": self.allocator.num_shared_blocks,  # held by several sequences, stored once
            "num_running": len(batcher.running),
            "num_waiting": len(batcher.waiting),
            "num_preemptions": batcher.num_preemptions,
            "prefix_cache_hit_tokens": batcher.prefix_cache_hit_tokens,  # prompt tokens, at first admission
            "recompute_cache_hit_tokens": batcher.recompute_cache_hit_tokens,  # preempted sequences' re-admissions
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
