"""minfer: a from-scratch GPT-2 inference engine in pure PyTorch."""

from .engine import LLM
from .sampling import SamplingParams
from .scheduler import OnlineScheduler
from .sequence import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "OnlineScheduler"]
__version__ = "0.1.0"
