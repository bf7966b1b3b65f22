"""CompiledDecodeStep: a decode step's transformer blocks run through one torch.compile graph (--compile-decode-step),
or most steps through one graph of the whole forward with frozen weights (--compile-model).

At batch 1 a CPU decode step spends a third of its time outside the weight matmuls: layer norms,
residual adds, activations, RoPE, int8 activation rounding, each a separate eager op with its own
dispatch cost. Compiled, Inductor fuses everything between a block's matmuls into a few C++ loops.
Two things stay opaque ops in the graph, called as they are: paged attention (the backend's Python
and its own compiled kernel, compiled/paged_op.py) and the prepacked linears (cpu/packing.py; a lone
fp32 row's split copies are plain torch, and compile in).
Quantized linears are plain torch, so their activation rounding fuses too.

What is compiled is one block, not the whole forward ("regional compilation"): every layer runs the
same Block.forward on weights of the same shapes, so the one graph serves them all, its layer index
an input rather than a constant. Dynamo traces one layer instead of 28, which is what a start paid
for (Qwen3-0.6B: a whole-forward graph took 61 s to compile, and 31 s again on a second start,
Inductor's on-disk cache notwithstanding; one block takes a few seconds). The price is Dynamo's
call cost once per layer, tens of microseconds, instead of once per step. The embedding, the final
norm and the LM head stay eager: nothing around them to fuse.

`--compile-model` compiles the whole forward instead, one graph per step, with the weights
frozen into it as constants (Inductor's `freezing`) and `max_autotune` on. Then Inductor packs each
weight for GEMM kernels it generates itself (its C++ templates, AMX tiles where the CPU has them),
which neither shared block graphs (whose weights are inputs) nor eager oneDNN get: on an AMX host
GPT-2's 48 linears at one bf16 row took 4.9 ms against 8.4 for the prepacked oneDNN ones, and int8
weight-only linears beat bf16 at every row count. The price:
a slower first start (Dynamo traces every layer, Inductor autotunes each weight shape), and a packed
copy of the weights beside the model's plain ones that eager steps use (one for both packages,
shared_constants.py; each in-memory graph holds its own). That graph serves prefill and mixed steps
too (the templates are fast at every row count, and quantized models have no fast eager path for
many rows), all but a lone sequence's prefill. A lone
sequence's decode gets a graph of its own, and there attention is traced in too (compiled/attention.py,
`lone_decode_in_graph`): at batch 1 the attention op's Python was a quarter of an int8 GPT-2 step.

Only steps where every row decodes take the block graph; prefill and mixed steps run eager, as vLLM keeps
CUDA graphs to decode batches. `dynamic=True`, so batch sizes do not recompile (a lone sequence
gets a graph of its own: dynamic shapes still specialise size 1). `warm_up` compiles both before
the engine takes its first request. Anything that fails turns the graph off, with one log line, and
the step runs eager. Bit-exact it is not: fused bf16 ops round differently.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.fx.experimental._config as fx_config

from ..attention.kv_cache import cdiv
from ..attention.paged import PagedBatch
from ..cpu.features import cpu_has_amx
from ..engine.model_runner import ModelRunner, StepRows
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import ScheduledChunk, Sequence
from .attention import failure_line
from .cache_key import model_fingerprint
from .paged_op import OpaqueAttention, compiled_step
from .precompiled import PrecompiledFunction, compile_for_cpu
from .packaged import PackagedForward, load_or_build
from .saved_graphs import CompileRecord, warm_up_saved

log = logging.getLogger("minfer")


class CompiledDecodeStep:
    """Called as the model is, (input_ids (N,), paged) -> logits (S, V); runs all-decode steps' blocks
    compiled, or (`whole`) the steps `serves` names through the frozen whole-forward graph."""

    def __init__(self, model: torch.nn.Module, whole: bool = False, lone_only: bool = False):
        self.model = model
        self.whole = whole  # the whole forward with frozen weights (--compile-model), else the block graph
        self.lone_only = whole and lone_only  # the whole forward for a lone sequence's decode alone: batches eager
        self.fusion_off = False  # the whole forward compiled in memory without epilogue fusion, after an error
        self.off_because: str | None = None  # why the graph stopped serving, once it has
        self.layers: list[torch.nn.Module] = []  # the blocks the block graph runs (none for the whole forward)
        if whole:
            self.graph = compile_for_cpu(model, **whole_forward_options(model))
        else:
            try:
                self.layers = decoder_layers(model)
            except ValueError as e:  # a model of another shape: it runs eager
                self.off_because = str(e)
                log.warning("minfer: the compiled decode step is off, running eager instead: %s", e)
            # The class's forward, called with each block as `self`: one graph for every layer, its graphs
            # saved in minfer's compile cache and loaded by the next start (saved_graphs.py).
            block = type(self.layers[0]) if self.layers else None
            self.graph = PrecompiledFunction(block.forward, f"{block.__name__}.forward") if block else None
        self.compiled_batches: set[bool] = set()  # which graphs have run: one sequence, several
        self.num_eager_steps = 0  # steps the graphs did not serve
        self.num_whole_steps = 0  # steps the whole forward's graphs served (bench.py --profile reads it)
        self.warm_up_seconds: float | None = None
        self.compile_record: CompileRecord | None = None  # how warm_up had its graphs: loaded or compiled
        self.opaque: OpaqueAttention | None = None  # the graph's view of the engine's attention (warm_up)
        self.packaged: PackagedForward | None = None  # the whole forward from AOTInductor packages (packaged.py)

    def warm_up(self, runner: ModelRunner) -> None:
        """Compile both graphs before the first request, so that none waits on the compiler: a decode
        step of one sequence, then one of BATCH_WARM_UP_ROWS, laid out by the runner's own `prepare`, so
        the inputs are exactly a served step's (Dynamo guards on their layout). The steps write K/V into
        block 0, which is free at start-up and is written again before any sequence reads it. The block
        graph's graphs come from minfer's compile cache where it has them; the whole forward on a CPU from its
        AOTInductor packages there (packaged.py), else it is traced again, with Inductor's caches in minfer's."""
        start = time.perf_counter()
        self.opaque = OpaqueAttention(runner.attention)

        def steps() -> str | None:
            for kind in WARM_UP_STEPS:
                rows, batch = warm_up_step(runner, kind)
                if self.whole:  # the cache's sizes never change. Symbolic, the views of it that a graph hands
                    torch._dynamo.mark_static(batch.kv_cache.kv)  # to store_kv all lost their offsets (torch 2.13)
                self(rows.input_ids, batch)
                if self.off_because:
                    return self.off_because
            return None

        saved = [self.graph] if isinstance(self.graph, PrecompiledFunction) else []
        parts = {
            "model": model_fingerprint(self.model), "whole": self.whole, "block_size": runner.block_size,
            "attention": runner.attention.name, "lone_decode_in_graph": runner.attention.lone_decode_in_graph,
            **({"lone_only": True} if self.lone_only else {}),  # its own entry: the keys before it stay as they were
        }
        if self.whole and runner.device.type == "cpu":
            why_not = self._packages(runner, parts)
            if why_not is None:
                self.warm_up_seconds = time.perf_counter() - start
                log.info("minfer: the whole forward's packages: %s", self.compile_record)
                return
            log.info("minfer: the whole forward is not packaged (%s): compiling it in memory", why_not)
        name = "whole-forward" if self.whole else "decode-step"
        why_not, self.compile_record = warm_up_saved(name, saved, parts, steps, runner.device)
        if why_not:
            return
        self.warm_up_seconds = time.perf_counter() - start
        log.info("minfer: the decode step's graphs: %s", self.compile_record)

    def _packages(self, runner: ModelRunner, parts: dict) -> str | None:
        """Load the whole forward's AOTInductor packages, or build them (packaged.py): None, or why not."""
        options = whole_forward_options(self.model)
        opaque = OpaqueAttention(runner.attention)
        kinds = ("lone",) if self.lone_only else ("lone", "batch")
        self.packaged, record, why_not = load_or_build(
            self.model, opaque, functools.partial(warm_up_step, runner), parts, options, kinds
        )
        if self.packaged is not None:
            self.compile_record = record
            self.compiled_batches = {True} if self.lone_only else {True, False}
        return why_not

    def __call__(self, input_ids: torch.Tensor, paged: PagedBatch) -> torch.Tensor:
        meta = paged.attention
        num_sampled, num_tokens = paged.sample_rows.shape[0], input_ids.shape[0]
        if self.whole and not self.lone_only and not self.off_because and num_tokens >= 2 and num_sampled < 2:
            return self._with_two_sampled_rows(input_ids, paged)
        if self.off_because or not self.serves(meta.all_decode, num_sampled, num_tokens):
            self.num_eager_steps += 1
            return self.model(input_ids, paged)
        lone = num_sampled == 1
        if self.whole and lone not in self.compiled_batches:  # the block graph logs its own (precompiled.py)
            log.info("minfer: compiling the whole forward for %s (once)", "one sequence" if lone else "batches")
        try:
            if self.packaged is not None:
                logits = self.packaged(input_ids, paged)
            elif self.whole:
                with compiled_step(paged), _graph_settings(whole=True):
                    logits = self.graph(input_ids, self.opaque.behind(paged))
            else:
                with compiled_step(paged), _graph_settings(whole=False), self._blocks_compiled():
                    logits = self.model(input_ids, self.opaque.behind(paged))
        except Exception as e:  # no C++ compiler, an Inductor error: all mean "run eager"
            if self._compiled_again_without_epilogue_fusion(e):
                return self(input_ids, paged)
            self.off_because = failure_line(e)
            log.warning("minfer: the compiled decode step is off, running eager instead: %s", self.off_because)
            return self.model(input_ids, paged)  # rewrites the same K/V slots, if any were written
        self.compiled_batches.add(lone)
        self.num_whole_steps += self.whole
        return logits

    def _compiled_again_without_epilogue_fusion(self, error: Exception) -> bool:
        """The whole forward compiled in memory, on the Inductor error a package is built again for (packaged.py's
        `_built`: Llama with int4 weights): compiled once more without epilogue fusion, as that package is. True
        if so; the step then runs again."""
        from torch._inductor.exc import InductorError

        if not self.whole or self.packaged is not None or not isinstance(error, InductorError) or self.fusion_off:
            return False
        log.warning("minfer: Inductor failed (%s): compiling the whole forward again without epilogue fusion",
                    failure_line(error))
        self.fusion_off = True
        self.graph = compile_for_cpu(self.model, **whole_forward_options(self.model), epilogue_fusion=False)
        self.compiled_batches.clear()
        return True

    def _with_two_sampled_rows(self, input_ids: torch.Tensor, paged: PagedBatch) -> torch.Tensor:
        """A lone prompt's chunk, sampling its last row (the prompt's end) or none (mid-prompt), through the
        batch graph: its sampled rows padded to two with copies of the last row, the extra logits dropped.
        The LM head reads a row or two more; eager, a quantized model's prefill was up to 3x slower."""
        num_sampled, sampled = paged.sample_rows.shape[0], paged.sample_rows
        last = sampled[-1:] if num_sampled else sampled.new_full((1,), input_ids.shape[0] - 1)
        # A view at storage offset 2, as the runner's are views at 3N of its one host->device copy: the
        # graph guards on the offset being at least 2 (sizes 0 and 1 specialise), and 0 would recompile.
        rows = torch.cat([sampled.new_empty(2), sampled, last.expand(2 - num_sampled)])[2:]  # (2,)
        return self(input_ids, replace(paged, sample_rows=rows))[:num_sampled]  # (S, V)

    def serves(self, all_decode: bool, num_sampled: int, num_tokens: int) -> bool:
        """Whether a step runs through the graph. The block graph: steps where every row decodes. The whole
        forward: a lone sequence's decode (its graph), and steps of two rows or more that sample two or
        more (the other; `__call__` pads a chunk that samples fewer). Sizes of 1 and 0 are specialised, so
        a step sampling several rows of one (n completions forking from a one-token prompt) would compile a
        third graph, with a third copy of the frozen weights: it runs eager. `lone_only`: the lone decode alone."""
        if not self.whole:
            return all_decode
        lone = num_sampled == 1 and num_tokens == 1
        return lone or (not self.lone_only and num_sampled >= 2 and num_tokens >= 2)

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


# The rows the frozen graph's batch variant is traced with. Its GEMMs are autotuned and blocked for them:
# at 2, torch's int8 kernel beat Inductor's template on a 50,257-row LM head, then was 10x slower at 64 rows;
# at 8, the bf16 templates re-read their weights for every few rows of a prompt, and a 512-token bf16 prefill
# took 698 ms against 432 at 64 (GPT-2, AMX host, one process), 64 requests 322 tok/s against 449. int8 was
# as fast or faster at 64 too, at 4, 16 and 64 requests.
BATCH_WARM_UP_ROWS = 64

# Inductor's settings for the whole-forward graph: weights frozen in as constants, and its own GEMM
# templates (C++) chosen by timing them at the traced rows (against torch's kernels: frozen_gemm_backends),
# without printing each timing table.
FROZEN_WEIGHTS = {
    "freezing": True,
    "max_autotune": True,
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def whole_forward_options(model: torch.nn.Module) -> dict:
    """Inductor's options for `model`'s whole forward, packaged or compiled in memory: FROZEN_WEIGHTS, the GEMM
    kernels it may choose from, and the thread count asked of OpenMP at run time (compile_for_cpu)."""
    return {**FROZEN_WEIGHTS, "max_autotune_gemm_backends": frozen_gemm_backends(model), "cpp.dynamic_threads": True}


def frozen_gemm_backends(model: torch.nn.Module) -> str:
    """Which GEMM kernels Inductor may choose from for the frozen graph. On a CPU with AMX, for bf16/fp16 and
    quantized weights, its C++ templates alone. There, against "CPP,ATEN", the steps ran as fast (GPT-2 at 1
    and 16 rows, bf16, int8, int4), and a first start took a fifth less, each GEMM no longer compiled and
    timed twice over: GPT-2 bf16 79 s against 103, int8 88 against 113 (alternating, 83 and 87 against 107
    and 113), int4 92 against 116; Qwen3-0.6B bf16 211 against 238 s (56 ms/token at batch 1 both). And with
    both, int4 once ran a lone sequence at 9.9 ms/token against 5.7: timing on a busy host can choose badly.
    fp32 weights keep torch's (oneDNN's) kernels as candidates: without them 16 rows ran 30% slower. Elsewhere,
    unmeasured, both. (Templates alone, a GEMM none of them runs fails the compile: the steps then run eager.)"""
    float_weights = {m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return "CPP" if cpu_has_amx() and float_weights <= {torch.bfloat16, torch.float16} else "CPP,ATEN"


@contextmanager
def _graph_settings(whole: bool) -> Iterator[None]:
    """Dynamo's settings for a step through a graph (any call may compile):
    - for the block graph, an int on a module (a block's layer index) is an input of the graph, not
      a constant to guard on, so every layer runs the same graph. Not for the whole forward: its
      head counts would become inputs too, and Inductor's GEMM templates want the weights' widths;
    - for the whole forward, Inductor's `freezing`, which Dynamo reads too (as it traces, to take
      the parameters as constants): FROZEN_WEIGHTS, passed to torch.compile, reach Inductor only;
    - no duck sizing: sizes that happen to be equal in this step (the layer count and a batch size,
      say) are not assumed equal ever after.
    Set and restored directly: `config.patch` around every step costs ~50 us, this ~10."""
    import torch._dynamo.config as dynamo_config  # here: importing Dynamo adds 1.3 s to every `minfer` start
    import torch._inductor.config as inductor_config

    saved = dynamo_config.allow_unspec_int_on_nn_module, fx_config.use_duck_shape, inductor_config.freezing
    dynamo_config.allow_unspec_int_on_nn_module, fx_config.use_duck_shape = not whole, False
    inductor_config.freezing = whole
    try:
        yield
    finally:
        dynamo_config.allow_unspec_int_on_nn_module, fx_config.use_duck_shape, inductor_config.freezing = saved


# The steps a warm-up runs, in order: a decode of one sequence, then one of BATCH_WARM_UP_ROWS, each sequence's
# context length. Equal lengths: one decode group in every backend.
WARM_UP_STEPS = {"lone": (3,), "batch": (4,) * BATCH_WARM_UP_ROWS}


def warm_up_step(runner: ModelRunner, kind: str) -> tuple[StepRows, PagedBatch]:
    """The warm-up step `kind` (WARM_UP_STEPS) as (rows, batch), laid out by the runner's own `prepare`. Made
    when it runs: the next one's layout could reuse what this one's holds."""
    chunks = [ScheduledChunk(_placeholder_sequence(n, runner.block_size), n - 1, 1) for n in WARM_UP_STEPS[kind]]
    rows = runner.prepare(chunks)
    return rows, runner.batch(rows)


def _placeholder_sequence(num_tokens: int, block_size: int) -> Sequence:
    """A decoding sequence of `num_tokens` token-0s whose blocks are all block 0, for `warm_up`."""
    seq = Sequence("warm-up", [0] * num_tokens, SamplingParams(max_tokens=1))
    seq.block_table = [0] * cdiv(num_tokens, block_size)
    return seq
