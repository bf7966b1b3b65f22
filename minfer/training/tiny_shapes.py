"""The two shapes train_tiny.py trains: GPT-2 (`--arch gpt2`, minfer-tiny) and Llama (`--arch llama`,
minfer-tiny-llama). For each: its config.json, minfer's module for it, its initialisation and the tensors
it writes under transformers' names, so minfer and transformers both load the result.

Why two: GPT-2 is the architecture the tutorials build first. Llama's rotary positions let a model
this small learn to copy from its context (docs/speculative.md: GPT-2's learned positions kept it at
the first ~60 positions), which n-gram speculative decoding needs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..checkpoints.random_gpt2 import make_config
from ..checkpoints.random_llama import llama_config
from ..models.config import GPT2Config
from ..models.gpt2 import CONV1D_WEIGHTS, GPT2
from ..models.llama import Llama
from ..models.llama_config import LlamaConfig

ARCHS = {"gpt2": GPT2, "llama": Llama}
RESIDUAL_PROJECTIONS = ("c_proj.weight", "o_proj.weight", "down_proj.weight")  # what writes into the stream


def llama_mlp_width(n_embd: int) -> int:
    """SwiGLU's hidden width: 8/3 of the model's (three matrices cost what GPT-2's two 4x ones do),
    rounded up to a multiple of 32."""
    return 32 * math.ceil(8 * n_embd / 3 / 32)


def tiny_config(arch: str, vocab_size: int, eos_id: int, n_positions: int, n_embd: int, n_layer: int,
                n_head: int) -> dict:
    """config.json for a model of this shape, in the format transformers writes."""
    if arch == "gpt2":
        config = make_config("tiny", vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd,
                             n_layer=n_layer, n_head=n_head)
        config["eos_token_id"] = config["bos_token_id"] = eos_id
        return config
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    return llama_config("llama", eos_id, eos_id, vocab_size=vocab_size, hidden_size=n_embd,
                        intermediate_size=llama_mlp_width(n_embd), num_hidden_layers=n_layer,
                        num_attention_heads=n_head, num_key_value_heads=n_head, head_dim=n_embd // n_head,
                        max_position_embeddings=n_positions, rms_norm_eps=1e-6, rope_theta=10000.0,
                        tie_word_embeddings=True)


def build_model(config: dict) -> nn.Module:
    """minfer's module for `config` (tiny_config's), with uninitialised weights."""
    if config["model_type"] == "gpt2":
        return GPT2(GPT2Config(vocab_size=config["vocab_size"], n_positions=config["n_positions"],
                               n_embd=config["n_embd"], n_layer=config["n_layer"], n_head=config["n_head"]))
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
             "tie_word_embeddings")
    return Llama(LlamaConfig(**{name: config[name] for name in names}))


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2's initialisation, for either shape: N(0, 0.02), zero biases, norms at one, and the
    projections into the residual stream scaled by 1/sqrt(2 n_layer), so its variance does not grow
    with depth."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif ".ln_" in name or name.startswith("ln_") or "norm" in name:
            nn.init.ones_(p)
        elif name.endswith(RESIDUAL_PROJECTIONS):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))
        else:
            nn.init.normal_(p, std=0.02)


def checkpoint_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The module's weights under its checkpoint's names, the tied LM head left out (it is the
    embedding): GPT-2's Conv1D weights back to [in, out]; Llama's under `model.`."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if isinstance(model, GPT2):
            t = t.t() if name.endswith(CONV1D_WEIGHTS) else t
        else:
            name = "model." + name
        out[name] = t.detach().to(dtype).contiguous()
    return out


def describe(config: dict) -> tuple[str, str, int]:
    """(architecture, transformers/minfer classes, MLP width), for the model card."""
    if config["model_type"] == "gpt2":
        return "GPT-2", "GPT2LMHeadModel (transformers' GPT-2; minfer's models/gpt2.py)", 4 * config["n_embd"]
    classes = "LlamaForCausalLM (transformers' Llama: rotary positions, RMSNorm, SwiGLU; minfer's models/llama.py)"
    return "Llama", classes, config["intermediate_size"]
