"""The runner's forward through compiled execution: where a step runs as a graph instead of eagerly.

The core's ModelRunner.forward asks `CompiledForward.forward(rows)` first; None means "run it eagerly".
- On a GPU (unless --enforce-eager), all-decode steps replay a CUDA graph (cuda_graphs.py).
- With --compile-decode-step or --compile-model, the compiled step (step.py) serves the steps it
  compiled for, and runs the others eagerly itself.
`warm_up` compiles and captures before the first request, from the runner's own layout of a step, so
the graphs are made for exactly what serving passes them.
"""

from __future__ import annotations

import torch

from ..engine.model_runner import ModelRunner, StepRows
from .cuda_graphs import DecodeGraphs
from .step import CompiledDecodeStep


class CompiledForward:
    def __init__(
        self, step: CompiledDecodeStep | None = None, graphs: bool = False, max_num_seqs: int = 1, context_len: int = 0
    ):
        self.step = step  # --compile-decode-step / --compile-model
        self.wants_graphs = graphs  # CUDA graphs for decode steps
        self.max_num_seqs = max_num_seqs
        self.context_len = context_len  # the longest sequence: the model's context, or --max-model-len
        self.graphs: DecodeGraphs | None = None
        self.runner: ModelRunner | None = None

    @torch.inference_mode()  # as every step runs: Dynamo guards on it
    def warm_up(self, runner: ModelRunner) -> None:
        self.runner = runner
        if self.step is not None:
            self.step.warm_up(runner)
        if self.wants_graphs:
            longest = min(self.context_len, runner.kv_cache.null_block * runner.block_size)  # null_block: the block count
            self.graphs = DecodeGraphs(
                runner.model, runner.attention, runner.kv_cache, runner.block_size, self.max_num_seqs, longest
            )
            self.graphs.capture_all()

    def forward(self, rows: StepRows) -> torch.Tensor | None:
        """Logits (S, V) of a step a graph serves; None for the runner to run eagerly."""
        num_sampled = rows.sample_rows.shape[0]
        if self.graphs is not None and self.graphs.serves(rows.layout, num_sampled):
            return self.graphs.run(rows.input_ids, rows.layout, rows.positions)
        if self.step is not None:
            return self.step(rows.input_ids, self.runner.batch(rows))
        return None

    def running(self) -> dict:
        """EngineConfig fields as they run: a compiled step whose warm-up failed runs eagerly."""
        compiles = self.step is not None and self.step.off_because is None
        return {
            "compile_decode_step": compiles and not self.step.whole,
            "compile_model": compiles and self.step.whole,
        }

    def describe(self) -> str:
        """For the start-up banner: what runs compiled or replays graphs, and what the warm-up took."""
        out, step, graphs = "", self.step, self.graphs
        if step is not None and step.off_because:
            out += f"; decode step eager (its compile failed: {step.off_because})"
        elif step is not None and step.warm_up_seconds is not None:
            what = "steps compiled whole, weights frozen" if step.whole else "decode steps compiled"
            out += f"; {what} (warm-up compile {step.warm_up_seconds:.1f} s)"
        if graphs is not None and graphs.capture:
            sizes, seconds = len(graphs.sizes), graphs.capture_seconds
            out += f"; decode steps replay CUDA graphs, {sizes} batch sizes (captured in {seconds:.1f} s)"
        return out

    def close(self) -> None:
        """Free the CUDA graphs and their memory (the engine's close())."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

