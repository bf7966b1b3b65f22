"""minfer: a from-scratch GPT-2 inference engine in pure PyTorch."""

__version__ = "0.1.0"
