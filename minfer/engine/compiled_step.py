"""CompiledDecodeStep: a decode step's whole model forward as one torch.compile graph (--compile-decode-step).

At batch 1 a CPU decode step spends a third of its time outside the weight matmuls: layer norms,
residual adds, activations, RoPE, int8 activation rounding, each a separate eager op with its own
dispatch cost. Compiling them piece by piece pays Dynamo's call cost per piece, about what the
pieces cost (docs/performance.md). So this compiles the model's forward whole, once per step:
Inductor fuses everything between the matmuls into a few C++ loops. Two things stay opaque ops in
the graph, called as they are: paged attention (the backend's Python and its own compiled kernel,
attention/paged.py) and the prepacked linears (cpu_packing.py). Quantized linears are plain torch,
so their activation rounding fuses too.

Only steps where every row decodes take the graph; prefill and mixed steps run eager, as vLLM keeps
CUDA graphs to decode batches. `dynamic=True`, so batch sizes do not recompile (a lone sequence
gets a graph of its own: dynamic shapes still specialise size 1). `warm_up` compiles both before
the engine takes its first request: 8 s for GPT-2, 61 s for Qwen3-0.6B (one thread). A later start
finds Inductor's code in its on-disk cache but still traces the model (Dynamo's part): 8 s and 31 s.
Anything that fails turns the graph off, with one log line, and the step runs eager. Bit-exact it
is not: fused bf16 ops round differently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.fx.experimental._config as fx_config

from ..attention.compiled import failure_line
from ..attention.kv_cache import cdiv
from ..attention.paged import PagedBatch, compiled_step
from .sampling import SamplingParams
from .sequence import ScheduledChunk, Sequence

log = logging.getLogger("minfer")


class CompiledDecodeStep:
    """Called as the model is, (input_ids (N,), paged) -> logits (S, V); runs all-decode steps compiled."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # dynamic_threads: the C++ loops ask OpenMP for the thread count at run time (cpu_share.py).
        self.graph = torch.compile(model.forward, dynamic=True, options={"cpp.dynamic_threads": True})
        self.off_because: str | None = None  # why the graph stopped serving, once it has
        self.compiled_batches: set[bool] = set()  # which graphs have run: one sequence, several
        self.warm_up_seconds: float | None = None

    def warm_up(self, prepare: Callable[[list[ScheduledChunk]], tuple], block_size: int) -> None:
        """Compile both graphs before the first request, so that none waits on the compiler: a decode
        step of one sequence, then one of two. `prepare` is the runner's, so the inputs are laid out
        exactly as a served step's (Dynamo guards on their layout). The steps write K/V into block 0,
        which is free at start-up and is written again before any sequence reads it."""
        start = time.perf_counter()
        for contexts in ((3,), (4, 4)):  # equal lengths: one decode group in every backend
            chunks = [ScheduledChunk(_placeholder_sequence(n, block_size), n - 1, 1) for n in contexts]
            input_ids, batch, _ = prepare(chunks)
            self(input_ids, batch)
            if self.off_because:
                return
        self.warm_up_seconds = time.perf_counter() - start
        log.info("minfer: compiled the decode step in %.1f s", self.warm_up_seconds)

    def __call__(self, input_ids: torch.Tensor, paged: PagedBatch) -> torch.Tensor:
        meta = paged.attention
        if self.off_because or not getattr(meta, "all_decode", False):
            return self.model(input_ids, paged)
        lone = paged.sample_rows.shape[0] == 1
        compiling = lone not in self.compiled_batches
        if compiling:
            log.info("minfer: compiling the decode step for %s (once)", "one sequence" if lone else "batches")
        try:
            # Duck sizing off while compiling: sizes that happen to be equal in this step (the layer count
            # and a batch size, say) are not assumed equal ever after. (Not around every call: 70 us.)
            with compiled_step(paged), fx_config.patch(use_duck_shape=False) if compiling else nullcontext():
                logits = self.graph(input_ids, paged)
        except Exception as e:  # no C++ compiler, an Inductor error: all mean "run eager"
            self.off_because = failure_line(e)
            log.warning("minfer: the compiled decode step is off, running eager instead: %s", self.off_because)
            return self.model(input_ids, paged)  # rewrites the same K/V slots, if any were written
        self.compiled_batches.add(lone)
        return logits


def _placeholder_sequence(num_tokens: int, block_size: int) -> Sequence:
    """A decoding sequence of `num_tokens` token-0s whose blocks are all block 0, for `warm_up`."""
    seq = Sequence("warm-up", [0] * num_tokens, SamplingParams(max_tokens=1))
    seq.block_table = [0] * cdiv(num_tokens, block_size)
    return seq
