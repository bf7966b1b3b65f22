"""Decode steps replayed from CUDA graphs, as vLLM and nano-vllm run them: on a GPU, unless --enforce-eager.

On a GPU a small model's decode step is mostly launch overhead: each of its few hundred kernels
costs the CPU microseconds to launch and the GPU runs it in less. A CUDA graph records a step's
kernels once and replays them all with one launch. A replay reuses the recorded addresses, so
every input of the step lives in a static buffer that each step copies into, and a batch is padded
up to the nearest size a graph was captured for (`graph_batch_sizes`). Padded rows decode token 0
at position 0 of the null block: they write only there and read only there.

What the step's attention needs is the backend's business: `graph_metadata` builds it from the
static buffers with device ops alone, inside the graph (FlexBackend: the block mask). Only steps
where every row decodes, each sampled once, replay; prefill and mixed steps run eager, as in vLLM.
Every graph writes its logits into one shared buffer, (max_num_seqs, V): kept per graph, 256 Qwen3 rows
of them would hold about 0.67 GB across the batch sizes. The graphs share one memory pool too: they never
run at once.

`capture=False` runs the same padded steps without recording them: how the tests check, on a CPU,
everything here but the recording itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..attention.kv_cache import KVCache, cdiv, padded_tables
from ..attention.backend import StepLayout
from ..attention.paged import PagedBatch
from ..host_to_device import to_device

log = logging.getLogger("minfer")


@dataclass
class DecodeGraphStep:
    """What ModelRunner.prepare hands over for a step that replays: its layout and positions (S,)."""

    layout: StepLayout
    positions: torch.Tensor


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every 16 up to max_num_seqs (and it)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def wants_decode_graphs(device: torch.device, enforce_eager: bool, backend) -> bool:
    """On a GPU, with an attention backend that can build its metadata inside a graph, unless told not to."""
    return device.type == "cuda" and not enforce_eager and backend.captures_in_graphs


class DecodeGraphs:
    """Captures and replays all-decode steps, one graph per batch size of `graph_batch_sizes`."""

    def __init__(
        self, model, backend, kv_cache: KVCache, block_size: int, max_num_seqs: int, max_model_len: int, capture=None
    ):
        self.model, self.backend, self.kv_cache, self.block_size = model, backend, kv_cache, block_size
        self.capture = model.device.type == "cuda" if capture is None else capture  # recorded on a GPU only
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks = cdiv(max_model_len, block_size)  # columns of the static block tables
        self.null_block = kv_cache.null_block
        rows, device, long = self.sizes[-1], model.device, torch.long
        # The static inputs, at the largest size: a graph of B rows reads their first B.
        self.input_ids = torch.zeros(rows, dtype=long, device=device)
        self.positions = torch.zeros(rows, dtype=long, device=device)
        self.slot_mapping = torch.full((rows,), self.null_block * block_size, dtype=long, device=device)
        self.tables = torch.full((rows, self.max_blocks), self.null_block, dtype=long, device=device)
        self.context_lens = torch.ones(rows, dtype=long, device=device)
        self.sample_rows = torch.arange(rows, device=device)  # every row samples: logits (B, V)
        self.logits: torch.Tensor | None = None  # (rows, V): every graph's output, made by the first capture
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # batch size -> its graph (None: not recorded)
        self.pool = None  # one memory pool for every graph
        self.capture_seconds: float | None = None
        self.num_steps = 0  # steps served

    def serves(self, layout: StepLayout, num_sampled: int) -> bool:
        """Whether a step replays: every row decodes and samples once, within the largest size and tables."""
        S = len(layout.query_lens)
        return (
            num_sampled == S <= self.sizes[-1]
            and all(n == 1 for n in layout.query_lens)
            and max(layout.context_lens) <= self.max_blocks * self.block_size
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Record a graph for every size, the largest first (later ones fit in its memory pool)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._capture(size)
        self.capture_seconds = time.perf_counter() - start
        if self.capture:
            log.info("minfer: captured %d CUDA graphs for decode in %.1f s", len(self.sizes), self.capture_seconds)

    def run(self, input_ids: torch.Tensor, layout: StepLayout, positions: torch.Tensor) -> torch.Tensor:
        """An all-decode step (serves() said so): input_ids, positions (S,) -> logits (S, V)."""
        S, B = len(layout.query_lens), self.block_size
        size = next(n for n in self.sizes if n >= S)
        self.num_steps += 1
        width = max(cdiv(n, B) for n in layout.context_lens)
        tables = padded_tables(layout.block_tables, width, self.null_block)
        ints = to_device([row + [n] for row, n in zip(tables, layout.context_lens)], self.model.device)  # (S, W + 1)
        self.input_ids[:S].copy_(input_ids)
        self.positions[:S].copy_(positions)
        self.slot_mapping[:S].copy_(layout.slot_mapping)
        self.tables[:size].fill_(self.null_block)  # stale columns would mislead the backend's block index
        self.tables[:S, :width].copy_(ints[:, :width])
        self.context_lens[:S].copy_(ints[:, width])
        if size > S:  # padding rows: token 0 at position 0 of the null block
            self.input_ids[S:size] = 0
            self.positions[S:size] = 0
            self.slot_mapping[S:size] = self.null_block * B
            self.context_lens[S:size] = 1
        graph = self.graphs[size] if size in self.graphs else self._capture(size)
        if graph is None:  # not recorded (capture=False): run the padded step itself
            self.logits[:size].copy_(self._step(size))
        else:
            graph.replay()
        return self.logits[:S]

    def _step(self, size: int) -> torch.Tensor:
        """The step a graph records: the first `size` rows of the static buffers -> logits (size, V)."""
        meta = self.backend.graph_metadata(
            self.slot_mapping[:size], self.tables[:size], self.context_lens[:size], self.block_size, self.null_block
        )
        batch = PagedBatch(self.positions[:size], self.kv_cache, meta, self.sample_rows[:size])
        return self.model(self.input_ids[:size], batch)

    def _capture(self, size: int) -> torch.cuda.CUDAGraph | None:
        """Run the step once (compiling what it compiles, outside the recording), then record it."""
        logits = self._step(size)  # (size, V)
        if self.logits is None:  # the first capture is the largest size's
            self.logits = logits.new_empty((self.sizes[-1], logits.shape[-1]))
        del logits
        graph = None
        if self.capture:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                # The step's own logits are freed within the recording: the pool reuses them for the next graph.
                self.logits[:size].copy_(self._step(size))
            self.pool = graph.pool()
        self.graphs[size] = graph
        return graph

    def release(self) -> None:
        """Free the graphs, their memory pool and the logits buffer (the engine's close())."""
        self.graphs.clear()
        self.pool = None
        self.logits = None
        if self.capture:
            torch.cuda.empty_cache()
