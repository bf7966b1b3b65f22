"""The warm-up of an attention backend that compiles per kind of step (flex where it serves, flex_kernel.py):
one step of each kind through the model, before the first request, so that serving compiles nothing.

Each step is laid out by the runner's own `prepare` and run through the model's own forward, so what
reaches the compiler is what serving passes it: q as the model makes it, every layer's view of a normal
(not inference) cache, from layer 0's at offset 0 on. The kinds of step, by what Dynamo specialises on:
- a lone decode and a batch of decodes (a batch of 1 is a size of its own);
- prefill chunks over earlier context, one per `kernel_options` bucket (up to 16 queries, more) and one
  longer than a query tile (one tile is a size of its own), as far as the step budget and context allow;
- a step that mixes decodes with a chunk.
Fresh prompts need no warm-up: they attend by sdpa over their own keys. The steps write into a small
cache of their own, so a warm-up that overruns its budget, abandoned in its thread, touches nothing the
engine serves from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..attention.kv_cache import KVCache, cdiv
from ..attention.backend import AttentionBackend
from ..attention.paged import PagedBatch
from ..engine.model_runner import ModelRunner
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import ScheduledChunk, Sequence
from .attention import check_within
from .flex_kernel import QUERY_TILE, compiling_for_serving

WARM_UP_BUDGET_S = 240.0  # longest the engine's warm-up steps may compile before it runs the plain backend
SHORT_CHUNK = 5  # queries of a chunk in the first kernel_options bucket (up to 16)
CHUNK = 40  # and in the second, within one query tile


@dataclass(frozen=True)
class WarmUpStep:
    """One step of the warm-up: each sequence's (tokens already cached, tokens this step)."""

    kind: str
    seqs: tuple[tuple[int, int], ...]


def warm_up_steps(block_size: int, max_num_batched_tokens: int, context_len: int) -> list[WarmUpStep]:
    """The kinds of step this engine can run, each once, within its step budget and context."""
    B, budget = block_size, max_num_batched_tokens
    long_chunk = min(budget, context_len - 1)  # after one cached token: the longest chunk with context
    steps = [
        WarmUpStep("lone decode", ((2 * B, 1),)),
        WarmUpStep("decode batch", ((B + 2, 1), (2 * B + 4, 1), (4, 1))),
        WarmUpStep("short chunk", ((B + 2, SHORT_CHUNK),)),
        WarmUpStep("chunk", ((1, CHUNK),)),
        WarmUpStep("chunk over several query tiles", ((1, long_chunk),)),
        WarmUpStep("decodes and a chunk", ((B, 1), (B + 1, SHORT_CHUNK))),
    ]
    fits = [s for s in steps if sum(n for _, n in s.seqs) <= budget and all(c + n <= context_len for c, n in s.seqs)]
    return [s for s in fits if s.kind != "chunk over several query tiles" or long_chunk > QUERY_TILE]


def warm_up_backend(
    runner: ModelRunner, backend: AttentionBackend, max_num_batched_tokens: int, context_len: int
) -> tuple[str | None, float | None]:
    """Run every kind of step through `backend`, in a thread, within WARM_UP_BUDGET_S: (None, or why the
    backend may not serve; the seconds it took, or None)."""
    steps = warm_up_steps(runner.block_size, max_num_batched_tokens, context_len)

    @torch.inference_mode()  # as every step runs: Dynamo guards on it
    def run() -> None:
        cache = backend.new_cache(
            runner.model.config, max(_blocks(s, runner.block_size) for s in steps), runner.block_size,
            runner.device, runner.model.dtype,
        )
        with compiling_for_serving():
            for step in steps:
                _run_step(runner, backend, cache, step)

    return check_within(run, WARM_UP_BUDGET_S)


def _blocks(step: WarmUpStep, block_size: int) -> int:
    return sum(cdiv(c + n, block_size) for c, n in step.seqs)


def _run_step(runner: ModelRunner, backend: AttentionBackend, cache: KVCache, step: WarmUpStep) -> None:
    """One step, laid out by the runner, on `cache`: each sequence on blocks of its own."""
    chunks, first_block = [], 0
    for cached, new in step.seqs:
        seq = Sequence("warm-up", [0] * (cached + new), SamplingParams(max_tokens=1))
        num_blocks = cdiv(cached + new, runner.block_size)
        seq.block_table = list(range(first_block, first_block + num_blocks))
        first_block += num_blocks
        chunks.append(ScheduledChunk(seq, cached, new))
    rows = runner.prepare(chunks)
    layout = replace(rows.layout, null_block=cache.null_block)
    runner.model(rows.input_ids, PagedBatch(rows.positions, cache, backend.build_metadata(layout), rows.sample_rows))
