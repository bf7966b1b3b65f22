"""What the engine knows of any model: the facts of ModelConfig, which every config in models/ provides
(GPT2Config, LlamaConfig). The KV cache, the scheduler and bench read these and nothing else, so they
run every architecture."""

from __future__ import annotations

from typing import Protocol


class ModelConfig(Protocol):
    """What the engine (KV cache, scheduler, bench) needs to know about any model."""

    vocab_size: int  # rows of the LM head: token ids are in [0, vocab_size)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # heads of keys and values the KV cache stores (fewer than query heads with GQA)
    head_dim: int
    max_positions: int  # the longest context the model supports
