"""GPT-2, written from scratch with torch.

The architecture (Radford et al., 2019): learned token and position embeddings,
a stack of pre-LayerNorm transformer blocks (fused-QKV causal self-attention,
then a GELU MLP), a final LayerNorm, and an LM head that reuses (is "tied to")
the token embedding matrix.

There is one forward pass. Without a cache it recomputes every position of a
padded (B, T) batch: the reference the tutorials start from and the parity tests
check. The engine passes a `PagedBatch` (attention/paged.py): then the input is
one row holding every token scheduled this step, from many sequences side by
side, attention reads and writes the paged KV cache, and the LM head runs only on
the rows that draw a token.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.paged import PagedBatch, paged_attention
from .config import GPT2Config


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu_fast": gelu_tanh, "gelu": F.gelu}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, layer: int):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.layer = layer  # which of the KV cache's layers holds this one's keys and values
        # One matmul makes queries, keys and values for every head at once.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor, paged: PagedBatch | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # Split the channels into heads: (B, T, C) -> (B, T, n_head, head_dim)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_head, self.head_dim)
        v = v.view(B, T, self.n_head, self.head_dim)
        if paged is None:
            # softmax(q k^T / sqrt(head_dim)) v, each position seeing only itself and the past.
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(1, 2)
        else:  # the engine's step (B == 1): store k, v in the cache, attend over each sequence's context
            kv_cache = paged.kv_cache.kv[self.layer]  # (num_slots, 2, nh, hd): this layer's keys and values
            y = paged_attention(q[0], k[0], v[0], kv_cache, paged.attention, self.scale)[None]
        return self.c_proj(y.reshape(B, T, C))  # heads side by side again: (B, T, nh, hd) -> (B, T, C)


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

    def __init__(self, config: GPT2Config, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, paged: PagedBatch | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), paged)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        # Given weights (uninitialised): random init is wasted on weights about to be loaded.
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, _weight=torch.empty(config.vocab_size, config.n_embd))
        self.wpe = nn.Embedding(
            config.n_positions, config.n_embd, _weight=torch.empty(config.n_positions, config.n_embd)
        )
        self.h = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the LM head reuses the token embedding matrix

    def forward(self, input_ids: torch.Tensor, paged: PagedBatch | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab_size), recomputing every position.

        With `paged` (the engine's step): input_ids (1, N) are every token scheduled this step,
        at positions paged.positions, and the result is (1, S, V): logits of the S rows that sample.
        """
        B, T = input_ids.shape
        if paged is None:
            if T > self.config.n_positions:
                raise ValueError(f"sequence length {T} exceeds the model's context of {self.config.n_positions}")
            pos = torch.arange(T, device=input_ids.device)  # (T,)
        else:
            pos = paged.positions  # (N,): each sequence's tokens continue where its context ends
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x, paged)
        if paged is not None:
            # The LM head is a third of GPT-2 small's weights: run it only where a token is drawn.
            x = x[:, paged.sample_rows]  # (1, S, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

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
        model.lm_head.weight = model.wte.weight  # assign=True made two parameters of one tensor: one again
        model.model_dir = model_dir
        return model.eval()
