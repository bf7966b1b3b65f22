"""GPT-2, written from scratch with torch.

The architecture (Radford et al., 2019): learned token and position embeddings, a stack of pre-LayerNorm
transformer blocks (fused-QKV causal self-attention, then a GELU MLP), a final LayerNorm, and an LM head
that reuses (is "tied to") the token embedding matrix (unless config.json's tie_word_embeddings is false).

There is one forward pass. Without a cache it recomputes every position of a padded (B, T) batch: the
reference the tutorials start from and the parity tests check. The engine passes a `PagedBatch`
(attention/paged.py): then the input is flat, (N,) tokens: every token scheduled this step, from many
sequences side by side; attention reads and writes the paged KV cache, and the LM head runs only on the
rows that draw a token. The end of the file maps a checkpoint's tensor names onto this module's (the
loader, loader.py, asks for it).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.paged import PagedBatch, paged_attention
from .config import GPT2Config
from .loader import from_pretrained


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
        # x is (B, T, C), or (N, C) in the engine's step: "..." below stands for (B, T) or (N,).
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)  # 3 x (..., C)
        # Split the channels into heads: (..., C) -> (..., n_head, head_dim)
        q = q.unflatten(-1, (self.n_head, self.head_dim))
        k = k.unflatten(-1, (self.n_head, self.head_dim))
        v = v.unflatten(-1, (self.n_head, self.head_dim))
        if paged is None:
            # softmax(q k^T / sqrt(head_dim)) v, each position seeing only itself and the past.
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hd)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).transpose(1, 2)
        else:  # the engine's step: store k, v in the cache, attend over each sequence's context
            kv_cache = paged.kv_cache.kv[self.layer]  # (num_slots, 2, nh, hd): this layer's keys and values
            y = paged_attention(q, k, v, kv_cache, paged.attention, self.scale)  # (N, nh, hd)
        return self.c_proj(y.flatten(-2))  # heads side by side again: (..., nh, hd) -> (..., C)


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
    def __init__(self, config: GPT2Config, model_dir: Path | None = None):
        super().__init__()
        self.config = config
        self.model_dir = model_dir  # the checkpoint it was loaded from (its tokenizer is there too)
        # Given weights (uninitialised): random init is wasted on weights about to be loaded.
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, _weight=torch.empty(config.vocab_size, config.n_embd))
        self.wpe = nn.Embedding(
            config.n_positions, config.n_embd, _weight=torch.empty(config.n_positions, config.n_embd)
        )
        self.h = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight  # tied: the LM head reuses the token embedding matrix

    def forward(self, input_ids: torch.Tensor, paged: PagedBatch | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab_size), recomputing every position. With `paged` (the engine's
        step): input_ids (N,), every token scheduled, at paged.positions -> logits (S, V) of the rows that sample."""
        if paged is None:
            T = input_ids.shape[1]
            if T > self.config.n_positions:
                raise ValueError(f"sequence length {T} exceeds the model's context of {self.config.n_positions}")
            pos = torch.arange(T, device=input_ids.device)  # (T,)
        else:
            pos = paged.positions  # (N,): each sequence's tokens continue where its context ends
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C), or (N, C)
        for block in self.h:
            x = block(x, paged)
        if paged is not None:
            # The LM head is a third of GPT-2 small's weights: run it only where a token is drawn.
            x = x[paged.sample_rows]  # (S, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V), or (S, V)

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
        return from_pretrained(cls, name_or_path, device, dtype)

    # ---- the checkpoint's names and shapes, which loader.py asks for -----------------------------
    # GPT-2 checkpoints come in two layouts:
    # - the Hub's openai-community/gpt2 file: names like `h.0.attn.c_attn.weight`, plus a
    #   causal-mask buffer `h.N.attn.bias` per layer (not a weight: skipped);
    # - transformers' `save_pretrained` output: the same names prefixed with `transformer.`.
    # Neither stores `lm_head.weight` where it is tied to `wte.weight`; an untied checkpoint
    # stores it as nn.Linear does, [out, in]. The four projection matrices are stored
    # Conv1D-style as [in, out]; nn.Linear wants [out, in]: transposed once.
    config_class = GPT2Config

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        name = key.removeprefix("transformer.")
        return None if SKIPPED.fullmatch(name) else name  # the causal-mask buffers are no weights

    @staticmethod
    def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...] | None]:
        """Every tensor a GPT-2 checkpoint holds, with its shape as stored on disk; None marks one to ignore."""
        C, F_, V, P = config.n_embd, config.mlp_dim, config.vocab_size, config.n_positions
        shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
        # A tied checkpoint may still carry lm_head.weight, the embedding's copy (one that differs unties: loader.py)
        shapes["lm_head.weight"] = None if config.tie_word_embeddings else (V, C)
        for i in range(config.n_layer):
            p = f"h.{i}."
            shapes |= {
                p + "ln_1.weight": (C,),
                p + "ln_1.bias": (C,),
                p + "attn.c_attn.weight": (C, 3 * C),
                p + "attn.c_attn.bias": (3 * C,),
                p + "attn.c_proj.weight": (C, C),
                p + "attn.c_proj.bias": (C,),
                p + "ln_2.weight": (C,),
                p + "ln_2.bias": (C,),
                p + "mlp.c_fc.weight": (C, F_),
                p + "mlp.c_fc.bias": (F_,),
                p + "mlp.c_proj.weight": (F_, C),
                p + "mlp.c_proj.bias": (C,),
            }
        return shapes

    @staticmethod
    def convert_weights(state: dict[str, torch.Tensor], config: GPT2Config) -> dict[str, torch.Tensor]:
        for name in state:
            if name.endswith(CONV1D_WEIGHTS):
                state[name] = state[name].t().contiguous()  # Conv1D [in, out] -> Linear [out, in]
        return state


CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SKIPPED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")  # causal-mask buffers, not weights
