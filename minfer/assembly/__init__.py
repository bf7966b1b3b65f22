"""The assembly: the one place the engine's core meets its features.

- build.py: `build_engine`, an OnlineScheduler and every feature room its EngineConfig asks for;
- prepare.py: a loaded model made ready to run (quantized, packed for the CPU) and its attention backend;
- selector.py: which attention backend a device and dtype get;
- llm.py: `LLM`, offline generation.
"""

from .build import build_engine

__all__ = ["build_engine"]
