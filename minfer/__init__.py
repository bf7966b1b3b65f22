"""minfer: a from-scratch GPT-2 inference engine in pure PyTorch."""

from .engine import LLM, Completion
from .sampling import SamplingParams
from .scheduler import OnlineScheduler

__all__ = ["LLM", "Completion", "SamplingParams", "OnlineScheduler"]
__version__ = "0.1.0"
