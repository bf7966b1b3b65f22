"""The Llama family (Llama, SmolLM2, Qwen3), written from scratch with torch.

What changed since GPT-2 (gpt2.py), each a few lines below:
- RMSNorm instead of LayerNorm: scale by the root mean square, no mean, no bias;
- rotary position embeddings (RoPE) instead of a learned position table: queries and
  keys are rotated by an angle proportional to their position, so q.k depends on
  how far apart two tokens are, not on where they sit;
- grouped-query attention (GQA): fewer key/value heads than query heads, each shared
  by a group of queries, so the KV cache holds fewer heads;
- Qwen3 only: an RMSNorm over each head's queries and keys, before the rotation;
- a SwiGLU MLP: down(silu(gate(x)) * up(x)) instead of c_proj(gelu(c_fc(x)));
- the LM head is tied to the embedding or a matrix of its own, as the config says.

The forward has the same signature as GPT-2's, so the engine runs either: plain
(B, T) -> (B, T, V), or the engine's step, (N,) tokens with a PagedBatch -> (S, V).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.paged import PagedBatch, paged_attention
from .llama_config import LlamaConfig
from .loader import from_pretrained


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the weight applied in the same call: the same bits, one op fewer
            return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)
        # x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype before the weight multiplies it (as in transformers)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_frequencies(config: LlamaConfig) -> torch.Tensor:
    """(head_dim / 2,) rotation speed of each pair of channels: theta^(-2i/head_dim)."""
    D = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D)
    s = config.rope_scaling
    if s is not None:  # Llama 3: slow the low frequencies down by `factor`, for a longer context
        old_context = s["original_max_position_embeddings"]
        low_wavelen = old_context / s["low_freq_factor"]  # wavelengths longer than this: scaled
        high_wavelen = old_context / s["high_freq_factor"]  # shorter than this: left alone
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        between = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq  # a blend of the two
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
        inv_freq = torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), between, inv_freq)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: channel i pairs with i + D/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair of x (B, T, H, D) by its position's angle; cos, sin are (T, D).
    In the engine's step x is (N, H, D) and cos, sin (N, D): one angle per token, as well."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D): the same rotation for every head
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        C, D = config.hidden_size, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.layer = layer  # which of the KV cache's layers holds this one's keys and values
        self.q_proj = nn.Linear(C, self.n_head * D, bias=config.attention_bias)
        self.k_proj = nn.Linear(C, self.n_kv_head * D, bias=config.attention_bias)
        self.v_proj = nn.Linear(C, self.n_kv_head * D, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_head * D, C, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = 1.0 / math.sqrt(D)

    def forward(self, x, cos, sin, paged: PagedBatch | None = None) -> torch.Tensor:
        # x is (B, T, C), or (N, C) in the engine's step: "..." below stands for (B, T) or (N,).
        q = self.q_proj(x).unflatten(-1, (self.n_head, self.head_dim))  # (..., nh, hd)
        k = self.k_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim))  # (..., n_kv, hd): fewer heads
        v = self.v_proj(x).unflatten(-1, (self.n_kv_head, self.head_dim))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if paged is None:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
            # enable_gqa: query head h reads key/value head h // (nh // n_kv).
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            y = y.transpose(1, 2)  # (B, T, nh, hd)
        else:  # the engine's step: store k, v in the cache, attend over each sequence's context
            kv_cache = paged.kv_cache.kv[self.layer]  # (num_slots, 2, n_kv_head, head_dim)
            y = paged_attention(q, k, v, kv_cache, paged.attention, self.scale)  # (N, nh, hd)
        return self.o_proj(y.flatten(-2))  # (..., nh * hd)


class MLP(nn.Module):
    """SwiGLU: a SiLU-gated linear unit. Three matrices instead of GPT-2's two."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(C, F_, bias=config.mlp_bias)
        self.up_proj = nn.Linear(C, F_, bias=config.mlp_bias)
        self.down_proj = nn.Linear(F_, C, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (..., C) -> (..., F) -> (..., C)


class Block(nn.Module):
    """Pre-norm block, as in GPT-2: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, paged: PagedBatch | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, paged)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, model_dir: Path | None = None):
        super().__init__()
        self.config = config
        self.model_dir = model_dir  # the checkpoint it was loaded from (its tokenizer is there too)
        V, C = config.vocab_size, config.hidden_size
        self.embed_tokens = nn.Embedding(V, C, _weight=torch.empty(V, C))  # uninitialised: weights get loaded
        self.layers = nn.ModuleList(Block(config, layer) for layer in range(config.num_hidden_layers))
        self.norm = RMSNorm(C, config.rms_norm_eps)
        self.lm_head = nn.Linear(C, V, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # No learned positions: a position's rotation angles are computed from these (kept in fp32).
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)

    def forward(self, input_ids: torch.Tensor, paged: PagedBatch | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab_size); with `paged`, (N,) -> (S, V) as in GPT2."""
        if paged is None:
            T = input_ids.shape[1]
            if T > self.config.max_position_embeddings:
                raise ValueError(
                    f"sequence length {T} exceeds the model's context of {self.config.max_position_embeddings}"
                )
            pos = torch.arange(T, device=input_ids.device)  # (T,)
        else:
            pos = paged.positions  # (N,)
        angles = pos[:, None].float() * self.inv_freq[None, :]  # (T, D/2) or (N, D/2), fp32 for long contexts
        angles = torch.cat((angles, angles), dim=-1)  # (T, D): channel i and i + D/2 turn together
        x = self.embed_tokens(input_ids)  # (B, T, C), or (N, C)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.layers:
            x = block(x, cos, sin, paged)
        if paged is not None:
            x = x[paged.sample_rows]  # (S, C): the LM head only where a token is drawn
        return self.lm_head(self.norm(x))  # (B, T, V), or (S, V)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "Llama":
        """Build the model from a local checkpoint directory or a Hugging Face Hub repo id."""
        return from_pretrained(cls, name_or_path, device, dtype)

    # ---- the checkpoint's names and shapes, which loader.py asks for -----------------------------
    config_class = LlamaConfig

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        """A tensor name in an HF checkpoint -> its name in Llama's state dict (None: not a weight)."""
        name = key.removeprefix("model.")
        return None if SKIPPED.fullmatch(name) else name

    @staticmethod
    def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...] | None]:
        """Every tensor the checkpoint must hold, with its shape; None marks an optional one to ignore."""
        C, F_, V, D = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
        H, KV = config.num_attention_heads, config.num_key_value_heads
        shapes: dict[str, tuple[int, ...] | None] = {"embed_tokens.weight": (V, C), "norm.weight": (C,)}
        # A tied checkpoint may still carry lm_head.weight, the embedding's copy (one that differs unties: loader.py)
        shapes["lm_head.weight"] = None if config.tie_word_embeddings else (V, C)
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (C,),
                p + "post_attention_layernorm.weight": (C,),
                p + "self_attn.q_proj.weight": (H * D, C),
                p + "self_attn.k_proj.weight": (KV * D, C),
                p + "self_attn.v_proj.weight": (KV * D, C),
                p + "self_attn.o_proj.weight": (C, H * D),
                p + "mlp.gate_proj.weight": (F_, C),
                p + "mlp.up_proj.weight": (F_, C),
                p + "mlp.down_proj.weight": (C, F_),
            }
            if config.attention_bias:
                shapes |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in zip("qkvo", (H * D, KV * D, KV * D, C))}
            if config.mlp_bias:
                shapes |= {
                    p + "mlp.gate_proj.bias": (F_,),
                    p + "mlp.up_proj.bias": (F_,),
                    p + "mlp.down_proj.bias": (C,),
                }
            if config.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
        return shapes

    @staticmethod
    def convert_weights(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
        return state  # stored as nn.Linear wants them


SKIPPED = re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # older exports store RoPE's constants
