"""GPT-2, written from scratch with torch.

The architecture (Radford et al., 2019): learned token and position embeddings,
a stack of pre-LayerNorm transformer blocks (fused-QKV causal self-attention,
then a GELU MLP), a final LayerNorm, and an LM head that reuses (is "tied to")
the token embedding matrix.

`GPT2.forward` is the plain, cache-free forward pass over a padded [B, T] batch:
the reference the tutorials start from and the parity tests check.
`GPT2.forward_paged` is the engine's path: every token scheduled this step,
flattened to (N, C), reading and writing the paged KV cache (paged_attention.py).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import GPT2Config
from .paged_attention import AttentionMetadata, paged_attention


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu_fast": gelu_tanh, "gelu": F.gelu}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        # One matmul makes queries, keys and values for every head at once.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # Split the channels into heads: (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        # softmax(q k^T / sqrt(head_dim)) v, each position seeing only itself and the past.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)  # heads side by side again
        return self.c_proj(y)

    def forward_paged(self, x: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        N, C = x.shape  # N tokens from any number of sequences, no padding
        q, k, v = self.c_attn(x).view(N, 3, self.n_head, self.head_dim).unbind(1)  # 3 x (N, nh, hd)
        y = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # (N, nh, hd)
        return self.c_proj(y.reshape(N, C))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_dim)
        self.act = ACTIVATIONS[config.activation_function]
        self.c_proj = nn.Linear(config.mlp_dim, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # (..., C) -> (..., 4C) -> (..., C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x

    def forward_paged(self, x: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn.forward_paged(self.ln_1(x), k_cache, v_cache, meta)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        # Given weights (uninitialised): random init is wasted on weights about to be loaded.
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, _weight=torch.empty(config.vocab_size, config.n_embd))
        self.wpe = nn.Embedding(config.n_positions, config.n_embd, _weight=torch.empty(config.n_positions, config.n_embd))
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.fast_lm_head: Callable | None = None  # on CPU, the engine sets a faster equivalent

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to vocabulary logits with the (tied) token embedding."""
        if self.fast_lm_head is not None:  # a prepacked copy of the same matrix, on CPU
            return self.fast_lm_head(hidden)
        return F.linear(hidden, self.wte.weight)  # (..., C) @ (V, C)^T -> (..., V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab_size), recomputing every position."""
        B, T = input_ids.shape
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds the model's context of {self.config.n_positions}")
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def forward_paged(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions (N,) -> final hidden states (N, C), before ln_f and the LM head.

        kv_cache holds k and v tensors (n_layer, num_slots, n_head, head_dim); meta says
        where each token's keys go and which context each sequence attends to.
        """
        x = self.wte(input_ids) + self.wpe(positions)  # (N, C)
        for i, block in enumerate(self.h):
            x = block.forward_paged(x, kv_cache.k[i], kv_cache.v[i], meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, C) hidden states of the positions that sample -> (S, V) logits.
        The LM head is a third of GPT-2-small's weights: run it only where a token is drawn."""
        return self.lm_head(self.ln_f(hidden))

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    @classmethod
    def from_pretrained(
        cls, name_or_path: str = "gpt2", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "GPT2":
        """Build the model from a local checkpoint directory or a Hugging Face Hub repo id."""
        from .loader import load_model_weights, resolve_model_dir

        model_dir = resolve_model_dir(name_or_path)
        config = GPT2Config.from_json(model_dir / "config.json")
        with torch.device("meta"):  # no memory and no random init for weights about to be replaced
            model = cls(config)
        state = load_model_weights(model_dir, config, device=device, dtype=dtype)
        model.load_state_dict(state, strict=True, assign=True)
        model.name_or_path = str(name_or_path)
        model.model_dir = model_dir
        return model.eval()
