"""CompiledDecodeStep: a decode step's transformer blocks run through one torch.compile graph (--compile-decode-step).

At batch 1 a CPU decode step spends a third of its time outside the weight matmuls: layer norms,
residual adds, activations, RoPE, int8 activation rounding, each a separate eager op with its own
dispatch cost. Compiled, Inductor fuses everything between a block's matmuls into a few C++ loops.
Two things stay opaque ops in the graph, called as they are: paged attention (the backend's Python
and its own compiled kernel, attention/paged.py) and the prepacked linears (cpu_packing.py).
Quantized linears are plain torch, so their activation rounding fuses too.

What is compiled is one block, not the whole forward ("regional compilation"): every layer runs the
same Block.forward on weights of the same shapes, so the one graph serves them all, its layer index
an input rather than a constant. Dynamo traces one layer instead of 28, which is what a start paid
for (Qwen3-0.6B: a whole-forward graph took 61 s to compile, and 31 s again on a second start,
Inductor's on-disk cache notwithstanding; one block takes a few seconds). The price is Dynamo's
call cost once per layer, tens of microseconds, instead of once per step. The embedding, the final
norm and the LM head stay eager: nothing around them to fuse.

Only steps where every row decodes take the graph; prefill and mixed steps run eager, as vLLM keeps
CUDA graphs to decode batches. `dynamic=True`, so batch sizes do not recompile (a lone sequence
gets a graph of its own: dynamic shapes still specialise size 1). `warm_up` compiles both before
the engine takes its first request. Anything that fails turns the graph off, with one log line, and
the step runs eager. Bit-exact it is not: fused bf16 ops round differently.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.fx.experimental._config as fx_config

from ..attention.compiled import compile_for_cpu, failure_line
from ..attention.kv_cache import cdiv
from ..attention.paged import PagedBatch, compiled_step
from .sampling import SamplingParams
from .sequence import ScheduledChunk, Sequence

log = logging.getLogger("minfer")


class CompiledDecodeStep:
    """Called as the model is, (input_ids (N,), paged) -> logits (S, V); runs all-decode steps' blocks compiled."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.off_because: str | None = None  # why the graph stopped serving, once it has
        try:
            self.layers = decoder_layers(model)
        except ValueError as e:  # a model of another shape: it runs eager
            self.layers, self.off_because = [], str(e)
            log.warning("minfer: the compiled decode step is off, running eager instead: %s", e)
        # The class's forward, called with each block as `self`: one graph for every layer.
        self.graph = compile_for_cpu(type(self.layers[0]).forward) if self.layers else None
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
        if lone not in self.compiled_batches:
            log.info("minfer: compiling the decode step for %s (once)", "one sequence" if lone else "batches")
        try:
            with compiled_step(paged), _block_graph_settings(), self._blocks_compiled():
                logits = self.model(input_ids, paged)
        except Exception as e:  # no C++ compiler, an Inductor error: all mean "run eager"
            self.off_because = failure_line(e)
            log.warning("minfer: the compiled decode step is off, running eager instead: %s", self.off_because)
            return self.model(input_ids, paged)  # rewrites the same K/V slots, if any were written
        self.compiled_batches.add(lone)
        return logits

    @contextmanager
    def _blocks_compiled(self) -> Iterator[None]:
        """For one step, each block's forward is the graph called with that block (the model is left as it was)."""
        for block in self.layers:
            block.forward = functools.partial(self.graph, block)
        try:
            yield
        finally:
            for block in self.layers:
                del block.forward  # back to the class's own


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: its longest ModuleList (GPT-2's `h`, Llama's `layers`)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of blocks to compile")
    blocks = list(max(lists, key=len))
    if len({type(b) for b in blocks}) != 1:
        raise ValueError(f"{type(model).__name__}'s blocks are not all of one class")
    return blocks


@contextmanager
def _block_graph_settings() -> Iterator[None]:
    """Dynamo's settings for a step through the block graph (any call may compile):
    - an int on a module (a block's layer index) is an input of the graph, not a constant to guard
      on, so every layer runs the same graph;
    - no duck sizing: sizes that happen to be equal in this step (the layer count and a batch size,
      say) are not assumed equal ever after.
    Set and restored directly: `config.patch` around every step costs ~50 us, this ~10."""
    import torch._dynamo.config as dynamo_config  # here: importing Dynamo adds 1.3 s to every `minfer` start

    saved = dynamo_config.allow_unspec_int_on_nn_module, fx_config.use_duck_shape
    dynamo_config.allow_unspec_int_on_nn_module, fx_config.use_duck_shape = True, False
    try:
        yield
    finally:
        dynamo_config.allow_unspec_int_on_nn_module, fx_config.use_duck_shape = saved


def _placeholder_sequence(num_tokens: int, block_size: int) -> Sequence:
    """A decoding sequence of `num_tokens` token-0s whose blocks are all block 0, for `warm_up`."""
    seq = Sequence("warm-up", [0] * num_tokens, SamplingParams(max_tokens=1))
    seq.block_table = [0] * cdiv(num_tokens, block_size)
    return seq
