"""The runner's forward through compiled execution: where a step runs as a graph instead of eagerly, and what
runs instead when a compiled path fails.

The core's ModelRunner.forward asks `CompiledForward.forward(rows)` first; None means "run it eagerly".
- On a GPU (unless --enforce-eager), all-decode steps replay a CUDA graph (cuda_graphs.py).
- With --compile-decode-step or --compile-model, the compiled step (step.py) serves the steps it
  compiled for, and runs the others eagerly itself.
- An attention backend that `compiles_per_shape` (flex where it serves) runs every step through here:
  `warm_up` has compiled each kind of step (warm_up.py), and a step that would compile again raises.
`warm_up` compiles and captures before the first request, from the runner's own layout of a step, so
the graphs are made for exactly what serving passes them.

No compiled path can stop the engine. At start-up, an attention warm-up that fails or overruns its budget
leaves the plain backend, on the same cache, and a capture that fails leaves eager decode steps. Mid-run, a
path that raises (a replay, a compiled step, a recompile where none may happen) is switched off and the step
runs once more, eagerly, on what is left. Each switch logs one line and is counted (`stats`: /metrics,
/health). A sticky CUDA error (errors.py) is not a path's: it goes up to the server, which stops.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from ..attention.backend import AttentionBackend
from ..attention.paged import PagedBatch
from ..attention.torch_sdpa import TorchBackend
from ..engine.model_runner import ModelRunner, StepRows
from ..device_errors import is_sticky_device_error
from .attention import failure_line
from .cuda_graphs import DecodeGraphs
from .flex_kernel import compiling_for_serving, sealed
from .step import CompiledDecodeStep
from .warm_up import warm_up_backend

log = logging.getLogger("minfer")


class CompiledForward:
    def __init__(
        self, step: CompiledDecodeStep | None = None, graphs: bool = False, max_num_seqs: int = 1, context_len: int = 0,
        max_num_batched_tokens: int = 512,
    ):
        self.step = step  # --compile-decode-step / --compile-model
        self.wants_graphs = graphs  # CUDA graphs for decode steps
        self.max_num_seqs = max_num_seqs
        self.context_len = context_len  # the longest sequence: the model's context, or --max-model-len
        self.max_num_batched_tokens = max_num_batched_tokens  # the longest chunk the warm-up must compile for
        self.graphs: DecodeGraphs | None = None
        self.runner: ModelRunner | None = None
        self.attention: AttentionBackend | None = None  # what steps run on: the runner's, until it fails
        self.sealed = False  # the attention compiled every kind of step: a step that would compile again raises
        self.warm_up_seconds: float | None = None  # the attention's warm-up steps
        self.fallbacks: list[str] = []  # one line per path switched off, at start-up or mid-run
        self.path: str | None = None  # the compiled path the step in progress runs: what a failure switches off

    @torch.inference_mode()  # as every step runs: Dynamo guards on it
    def warm_up(self, runner: ModelRunner) -> None:
        self.runner, self.attention = runner, runner.attention
        if self.attention.compiles_per_shape:
            why_not, self.warm_up_seconds = warm_up_backend(
                runner, self.attention, self.max_num_batched_tokens, self.context_len
            )
            if why_not:
                self._attention_off(f"its warm-up failed: {why_not}")
        if self.step is not None:
            self.step.warm_up(runner)
            self._count_if_the_step_went_off()
        if self.wants_graphs and self.attention.captures_in_graphs:
            self._capture(runner)
        self.sealed = self.attention.compiles_per_shape

    def _capture(self, runner: ModelRunner) -> None:
        """Record the decode graphs; if that fails, release what was recorded and run decode steps eagerly."""
        longest = min(self.context_len, runner.kv_cache.null_block * runner.block_size)  # null_block: the block count
        graphs = DecodeGraphs(
            runner.model, self.attention, runner.kv_cache, runner.block_size, self.max_num_seqs, longest
        )
        try:
            with compiling_for_serving() if self.attention.compiles_per_shape else nullcontext():
                graphs.capture_all()
        except Exception as e:
            if is_sticky_device_error(e):
                raise
            graphs.release()
            self._fell_back("CUDA graphs", f"capture failed: {failure_line(e)}")
            return
        self.graphs = graphs

    def forward(self, rows: StepRows) -> torch.Tensor | None:
        """Logits (S, V) of a step a compiled path serves; None for the runner to run eagerly."""
        try:
            return self._run(rows)
        except Exception as e:
            if self.path is None or is_sticky_device_error(e):
                raise
            self._switch_off(self.path, e)
            return self._run(rows)  # once, on what is left: a second failure is the step's own

    def _run(self, rows: StepRows) -> torch.Tensor | None:
        self.path = None
        if self.graphs is not None and self.graphs.serves(rows.layout, rows.sample_rows.shape[0]):
            self.path = "CUDA graphs"
            # A replay compiles nothing; a step not recorded (a CPU's, in tests) runs its Python: sealed too.
            with sealed() if self.sealed and not self.graphs.capture else nullcontext():
                return self.graphs.run(rows.input_ids, rows.layout, rows.positions)
        if self.step is not None and not self.step.off_because:
            self.path = "the compiled decode step"
            logits = self.step(rows.input_ids, self._batch(rows))
            self._count_if_the_step_went_off()
            return logits
        if self.sealed:
            self.path = "compiled attention"
            with sealed():
                return self.runner.model(rows.input_ids, self._batch(rows))
        if self.attention is not self.runner.attention:  # fell back to the plain backend
            return self.runner.model(rows.input_ids, self._batch(rows))
        return None

    def _batch(self, rows: StepRows) -> PagedBatch:
        """The runner's batch, with this attention's metadata."""
        meta = self.attention.build_metadata(rows.layout)
        return PagedBatch(rows.positions, self.runner.kv_cache, meta, rows.sample_rows)

    def _switch_off(self, path: str, error: Exception) -> None:
        """A path raised mid-run: off for good, one log line, one more count."""
        why = f"it raised mid-run: {failure_line(error)}"
        if path == "CUDA graphs":
            self.graphs.release()
            self.graphs = None
            self._fell_back(path, why)
        elif path == "the compiled decode step":
            self.step.off_because = why
            self._fell_back(path, why)
        else:  # the graphs already recorded keep replaying: they never compile
            self._attention_off(why)

    def _count_if_the_step_went_off(self) -> None:
        """The compiled step switches itself off where its compile fails (and logs it): counted here."""
        if self.step.off_because:
            self.fallbacks.append(f"the compiled decode step: {self.step.off_because}")

    def _attention_off(self, why: str) -> None:
        """The plain backend from here on: the same cache layout, nothing compiled."""
        self._fell_back(f"{self.attention.name} attention", why)
        self.attention = TorchBackend(self.attention.device, self.attention.dtype)
        self.sealed = False

    def _fell_back(self, what: str, why: str) -> None:
        self.fallbacks.append(f"{what}: {why}")
        log.warning("minfer: %s off, running eager instead: %s", what, why)

    def running(self) -> dict:
        """EngineConfig fields as they run: a compiled step whose warm-up failed runs eagerly, and so does
        attention whose warm-up failed."""
        compiles = self.step is not None and self.step.off_because is None
        out = {
            "compile_decode_step": compiles and not self.step.whole,
            "compile_model": compiles and self.step.whole,
        }
        if self.attention is not None and self.runner is not None and self.attention is not self.runner.attention:
            out["attention_backend"] = "eager"
        return out

    def stats(self) -> dict:
        """For /metrics (the paths switched off, counted) and /health (what runs now)."""
        paths = {"attention": self.attention.name if self.attention is not None else None}
        if self.wants_graphs:
            paths["cuda_graphs"] = "replaying" if self.graphs is not None else "off"
        if self.step is not None:
            paths["compiled_step"] = "off" if self.step.off_because else "on"
        cache = self.compile_cache()
        if cache:
            paths["compile_cache"] = cache
        return {"num_path_fallbacks": len(self.fallbacks),
                "compiled_paths": paths | {"fallbacks": list(self.fallbacks)}}

    def compile_cache(self) -> dict[str, str]:
        """How each path that compiled at start-up had its graphs: "loaded (warm, 1.2 s)" from minfer's
        compile cache, or "compiled (cold, 31.0 s)" (saved_graphs.py)."""
        out = {}
        attention = self.runner.attention if self.runner is not None else None
        if attention is not None and attention.compile_record is not None:
            out["attention"] = str(attention.compile_record)
        if self.step is not None and self.step.compile_record is not None:
            out["decode_step"] = str(self.step.compile_record)
        return out

    def describe(self) -> str:
        """For the start-up banner: what runs compiled or replays graphs, what the warm-up took, what fell back."""
        out, step, graphs = "", self.step, self.graphs
        if self.warm_up_seconds is not None:
            out += f"; each kind of step compiled at start-up ({self.warm_up_seconds:.1f} s)"
        if step is not None and step.off_because:
            out += f"; decode step eager (its compile failed: {step.off_because})"
        elif step is not None and step.warm_up_seconds is not None:
            what = "steps compiled whole, weights frozen" if step.whole else "decode steps compiled"
            out += f"; {what}, graphs {step.compile_record}"
        if graphs is not None and graphs.capture:
            sizes, seconds = len(graphs.sizes), graphs.capture_seconds
            out += f"; decode steps replay CUDA graphs, {sizes} batch sizes (captured in {seconds:.1f} s)"
        for line in self.fallbacks:
            out += f"; off, running eager: {line}"
        return out

    def close(self) -> None:
        """Free the CUDA graphs and their memory (the engine's close())."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
