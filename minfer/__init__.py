"""minfer: a from-scratch LLM inference engine in pure PyTorch (GPT-2, Qwen3, Llama).

The package is cut into layers, bottom up: attention, text, models, engine, server, with
bench and stress as clients; docs/architecture.md draws them. This file re-exports what
users import: `from minfer import LLM, SamplingParams` (and `EngineConfig`, `StructuredOutputsParams`).
"""

from . import settings  # first: it notes this process's CPUs before torch's OpenMP may bind it to one
from .engine.config import EngineConfig
from .assembly.llm import LLM
from .engine.sampling_params import SamplingParams
from .engine.scheduler import OnlineScheduler
from .engine.outputs import RequestOutput
from .engine.structured_outputs_params import StructuredOutputsParams
from .version import __version__

__all__ = ["EngineConfig", "LLM", "RequestOutput", "SamplingParams", "OnlineScheduler", "StructuredOutputsParams",
           "__version__"]
