"""QuantizedEmbedding: a token embedding whose table is a quantized matrix, dequantized a row at a time.

GPT-2 ties its LM head to the token embedding (and so do small Llamas and Qwen3): one (V, C) matrix,
a third of GPT-2 small's weights. Quantizing the head alone would keep a full-precision copy for the
lookup; instead the embedding reads the head's quantized matrix, and a step's lookup dequantizes only
the rows of the tokens it embeds. An untied embedding is quantized the same way (as llama.cpp does):
a table read a few rows per step, at a quarter or an eighth of its full-precision memory.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import QuantizedLinear


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over the rows of a QuantizedLinear (`table`, shared with a tied LM head)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        # Models read their device and dtype from the embedding's .weight; this stands in for the
        # (V, C) matrix that is no longer there: empty, in the dtype the activations have.
        self.register_buffer("dtype_marker", torch.empty(0, dtype=dtype, device=table.qweight.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.dtype_marker

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (...) -> (..., C)
        rows = self.table.rows(ids.reshape(-1), self.dtype_marker.dtype)  # (n, C)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, quantized"
