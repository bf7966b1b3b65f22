"""Where features attach to the core: one slot each, and what the core calls on it.

The core (this package) runs a plain engine: one token per sequence per step, the plain attention
backend, eager forwards. Each feature lives in a room of its own and acts only at the lines of
OnlineScheduler.step, OnlineScheduler.add_request and ModelRunner.execute that name its slot. The
core imports no room: `minfer.assembly.build_engine` builds the rooms a config asks for and hands
them in here. Each Protocol below lists what the core calls; the room that fills the slot is named
beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..attention.kv_cache import KVCache
from .continuous_batcher import ContinuousBatcher
from .model_runner import ModelRunner, StepRows
from .sampling_params import SamplingParams
from .sequence import ScheduledChunk, Sequence
from .step_stats import StepStats

BUILDER = "minfer.assembly.build_engine"  # the one function that attaches features


class Scoring(Protocol):
    """scoring/: logprobs of sampled tokens and of prompt positions (scoring/scorer.py). It acts only
    while a request that asked is alive (`live`), and records only a step that scored (`last`)."""

    live: object  # truthy while any sequence keeps logprobs
    last: object  # the step being scored, or None

    def add(self, seqs: list[Sequence]) -> None: ...  # a new request's sequences, which asked
    def cap_rows(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]: ...  # after the policy
    def rows(self, chunks: list[ScheduledChunk], rows: StepRows, device: torch.device): ...  # StepScores | None
    def record(self, chunks: list[ScheduledChunk]) -> None: ...  # after the step's tokens are recorded


class Forks(Protocol):
    """parallel_sampling/: n completions of one prompt on its shared blocks (parallel_sampling/forks.py).
    It acts only while some prompt's forks wait to start (`held`)."""

    held: dict  # a request's first sequence -> the sequences that will start from its prompt

    def hold(self, seqs: list[Sequence]) -> list[Sequence]: ...  # which of a request's sequences queue now
    def add_samplers(self, chunks: list[ScheduledChunk]) -> None: ...
    def start(self, chunks: list[ScheduledChunk], batcher: ContinuousBatcher, kv_cache: KVCache) -> None: ...
    def discard(self, first: Sequence) -> None: ...


class Speculation(Protocol):
    """speculative/: proposals verified in one forward (speculative/speculation.py)."""

    def propose(self, chunk: ScheduledChunk, budget: int, num_running: int) -> ScheduledChunk: ...  # in the policy
    def fill(self, chunks: list[ScheduledChunk]) -> None: ...  # once the step is scheduled
    def sample(self, chunks: list[ScheduledChunk],
               logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def read(self, chunks: list[ScheduledChunk], values: list[float]) -> None: ...
    def settle(self, chunks: list[ScheduledChunk], batcher: ContinuousBatcher, step: StepStats) -> None: ...
    def stats(self) -> dict: ...  # vLLM's spec_decode counters


class Structured(Protocol):
    """structured/: outputs held to a JSON schema, regex, choice or grammar by a token mask on the sampled
    rows (structured/structured.py). It acts only while a constrained sequence is alive (`live`)."""

    live: object  # truthy while any sequence holds a grammar

    def check(self, params: SamplingParams) -> None: ...  # at the edge: the grammar compiles, else InvalidParameter
    def add(self, seqs: list[Sequence]) -> None: ...  # a new request's sequences: a matcher each
    def start(self, chunks: list[ScheduledChunk]): ...  # before the forward: the step's masks begin filling
    def until_complete(self, seq: Sequence, tokens: list[int]) -> list[int]: ...  # a verification's tokens, cut
    def advance(self, chunks: list[ScheduledChunk]) -> list[tuple[Sequence, str]]: ...  # which end, and why


class Compiled(Protocol):
    """compiled/: a step's forward through a compiled graph or a CUDA graph (compiled/forward.py)."""

    def warm_up(self, runner: ModelRunner) -> None: ...
    def forward(self, rows: StepRows) -> torch.Tensor | None: ...  # None: not served, run eager
    def running(self) -> dict: ...  # EngineConfig fields as they run
    def stats(self) -> dict: ...  # paths switched off (counted) and what runs now: /metrics, /health
    def describe(self) -> str: ...  # for the start-up banner
    def close(self) -> None: ...


class Threads(Protocol):
    """cpu/: torch's thread count kept to the cores other processes leave free (cpu/thread_share.py)."""

    def update(self) -> int: ...


@dataclass
class Features:
    """The rooms an engine runs with; None where a feature is not attached."""

    scoring: Scoring | None = None
    forks: Forks | None = None
    speculation: Speculation | None = None
    structured: Structured | None = None
    compiled: Compiled | None = None
    threads: Threads | None = None
    settings: dict = field(default_factory=dict)  # EngineConfig fields as the assembly applied them

    def check(self, config) -> None:
        """A config that asks for a feature this engine lacks is refused, naming the function that attaches it."""
        wanted = {
            "--speculative-method": config.speculative_method is not None and self.speculation is None,
            "--compile-decode-step": config.compile_decode_step and self.compiled is None,
            "--compile-model": config.compile_model and self.compiled is None,
            "--quantization": config.quantization is not None and self.settings.get("quantization") is None,
        }
        missing = [name for name, lacking in wanted.items() if lacking]
        if missing:
            raise ValueError(f"{', '.join(missing)} need an engine built by {BUILDER}, which attaches the feature")

    def running(self) -> dict:
        """EngineConfig fields as the features run them (OnlineScheduler.engine_config)."""
        nothing_compiled = {"compile_model": False}  # unset (None) in a config is decided by now
        return nothing_compiled | self.settings | (self.compiled.running() if self.compiled is not None else {})
