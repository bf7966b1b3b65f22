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

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import GPT2Config
from .paged_attention import AttentionMetadata, paged_attention


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu_fast": gelu_tanh, "gelu": F.gelu}


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 run bf16 matmuls in hardware (AMX several times faster than fp32);
    without them (e.g. AVX2-only CPUs) torch emulates bf16 matmuls, slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


class Linear(nn.Linear):
    """nn.Linear (weight (out, in)), with two CPU fast paths measured on a 2-core AVX2 EPYC.

    fp32, any number of rows: MKL runs a skinny matmul (a decode step's few rows)
    on one core, reading weights at ~14 GB/s. Viewing the weight as one slice of
    output rows per thread and running the slices as a batched matmul puts every
    core to work: ~26 GB/s at one row, never slower at many (bench.py measures it).

    bf16 without native bf16 matmul (no AMX/AVX512-BF16): bf16 matmuls over many
    rows are emulated and ~6x slower than fp32, so they upcast to fp32 and keep
    bf16 only for storage. One row stays bf16: it is memory-bound, half the bytes win.
    """

    emulated_bf16 = not cpu_has_native_bf16()
    _slices: tuple | None = None  # (key, weight view, bias view), rebuilt if threads or tensors change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if x.dtype == torch.bfloat16 and self.emulated_bf16 and x.shape[0] >= 4:
            return F.linear(x.float(), self.weight.float(), self.bias.float()).to(x.dtype)
        threads, (out_features, in_features) = torch.get_num_threads(), self.weight.shape
        if x.dtype != torch.float32 or threads == 1 or out_features % threads:
            return F.linear(x, self.weight, self.bias)
        key = (threads, self.weight.data_ptr(), self.bias.data_ptr())
        if self._slices is None or self._slices[0] != key:
            w = self.weight.view(threads, out_features // threads, in_features).transpose(1, 2)  # (P, in, out/P)
            self._slices = (key, w, self.bias.view(threads, 1, out_features // threads))  # views, no copy
        _, w, b = self._slices
        M = x.shape[0]
        y = torch.baddbmm(b, x.expand(threads, M, in_features), w)  # (P, M, out/P): one slice per core
        return y.transpose(0, 1).reshape(M, out_features)  # (M, out)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        # One matmul makes queries, keys and values for every head at once.
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = Linear(config.n_embd, config.n_embd)
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
        self.c_fc = Linear(config.n_embd, config.mlp_dim)
        self.act = ACTIVATIONS[config.activation_function]
        self.c_proj = Linear(config.mlp_dim, config.n_embd)

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
        self.lm_head_slices: torch.Tensor | None = None  # CPU fp32 only, see compute_logits

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to vocabulary logits with the (tied) token embedding."""
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
        hidden = self.ln_f(hidden)
        if self.lm_head_slices is None:
            return self.lm_head(hidden)
        P, C, width = self.lm_head_slices.shape
        S = hidden.shape[0]
        logits = torch.bmm(hidden.expand(P, S, C), self.lm_head_slices)  # (P, S, V/P): a slice per core
        return logits.transpose(0, 1).reshape(S, P * width)[:, : self.config.vocab_size]  # (S, V)

    def slice_lm_head(self, num_slices: int) -> None:
        """Keep a copy of the LM head as `num_slices` contiguous (C, V/P) column slices.

        On CPU in fp32, MKL streams a (V, C) matrix at ~13 GB/s for one row and a (C, V)
        one at ~23 GB/s; one contiguous slice per core, run as a batched matmul, reaches
        ~33 GB/s (measured on a 2-core EPYC). The LM head is a third of GPT-2-small's
        weight bytes, so this is a fifth of a decode step. Costs a second copy (154 MB for gpt2).
        """
        V, C = self.wte.weight.shape
        width = -(-V // num_slices)
        padded = torch.zeros(num_slices * width, C, dtype=self.dtype, device=self.device)
        padded[:V] = self.wte.weight
        self.lm_head_slices = padded.t().reshape(C, num_slices, width).permute(1, 0, 2).contiguous()

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
        if model.device.type == "cpu" and dtype == torch.float32:
            model.slice_lm_head(torch.get_num_threads())
        model.name_or_path = str(name_or_path)
        model.model_dir = model_dir
        return model.eval()
