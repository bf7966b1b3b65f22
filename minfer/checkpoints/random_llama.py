"""Random Qwen3 and Llama checkpoints: the files a chat model ships, with random weights.

Besides config.json and model.safetensors (transformers' tensor names), a chat model ships a
tokenizer with its special tokens and a chat template (chat_tokenizers.py), and
generation_config.json listing the ids that end a reply. Three families: Qwen3, Llama 3
(`llama-tiny`: byte-level BPE) and Llama 2 (`llama2-tiny`: a SentencePiece-style tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .chat_tokenizers import LLAMA_SPECIALS, QWEN3_ADDED, QWEN3_SPECIALS, write_tokenizer
from .files import save_safetensors

TINY_LLAMA = dict(  # the tiny presets' shape; grouped-query attention: 4 query heads share 2 key/value heads
    vocab_size=512,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LLAMA_CONFIGS = {
    # Qwen3: explicit head_dim (here twice hidden / heads, as in Qwen3-0.6B), q/k norms, tied embeddings.
    "qwen3-tiny": {"family": "qwen3", **TINY_LLAMA, "intermediate_size": 128, "head_dim": 32},
    # Llama 3: head_dim = hidden / heads, an LM head of its own.
    "llama-tiny": dict(family="llama", **TINY_LLAMA),
    # Llama 2: the same shape with rotary base 10,000, and a SentencePiece-style tokenizer (`▁` for a space,
    # byte fallback, <s> before each prompt) with <unk>, <s>, </s> as ids 0, 1, 2.
    "llama2-tiny": dict(family="llama2", **TINY_LLAMA, rope_theta=10000.0),
    # The shape of Qwen/Qwen3-0.6B (0.6B parameters, stored in bf16 like the real one); its tokenizer
    # is smaller than the 151,936-row embedding (the real one's is too, if less so): 32k keeps it quick.
    "qwen3-0.6b": dict(
        family="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tokenizer_size=32000,
        torch_dtype="bfloat16",
    ),
}

def llama_config(family: str, bos_token_id: int, eos_token_id: int | list[int], **shape) -> dict:
    """A config.json dict in the format transformers writes for Qwen3ForCausalLM (family "qwen3") or
    LlamaForCausalLM ("llama"). `shape` gives the sizes (vocab_size, hidden_size, ...) and may override
    any of the family's defaults (rope_theta, rms_norm_eps, tie_word_embeddings...)."""
    common = dict(
        hidden_act="silu",
        rms_norm_eps=1e-6 if family == "qwen3" else 1e-5,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        torch_dtype="float32",
        use_cache=True,
    )
    if family == "qwen3":
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **common,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": shape["num_hidden_layers"],
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            **shape,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common,
        "mlp_bias": False,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        **shape,
    }


def make_llama_config(preset: str, **overrides) -> dict:
    """The config.json of a preset of LLAMA_CONFIGS: Llama 2's special tokens come first, the others' after
    the learned tokens."""
    shape = {**LLAMA_CONFIGS[preset], **overrides}
    family = shape.pop("family")
    shape.pop("tokenizer_size", None)
    if family == "llama2":
        return llama_config("llama", 1, 2, **shape)
    tokenizer_size = LLAMA_CONFIGS[preset].get("tokenizer_size", shape["vocab_size"])
    specials = QWEN3_SPECIALS if family == "qwen3" else LLAMA_SPECIALS
    added = QWEN3_ADDED if family == "qwen3" else []
    first_special = tokenizer_size - len(added) - len(specials)  # after the learned tokens
    ids = {t: first_special + i for i, t in enumerate(specials)}
    if family == "qwen3":
        return llama_config(family, ids["<|endoftext|>"], ids["<|im_end|>"], **shape)
    return llama_config(family, ids["<|begin_of_text|>"], [ids["<|end_of_text|>"], ids["<|eot_id|>"]], **shape)


def random_llama_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under transformers' names (nn.Linear weights are [out, in])."""
    g = torch.Generator().manual_seed(seed)
    C, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or C // H

    def normal(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * scale

    def linear(fan_in, fan_out):  # O(1) outputs, so each block really changes the residual stream
        return normal(fan_out, fan_in, scale=fan_in**-0.5)

    def norm_weight(n):  # near 1, but not exactly, so a missing norm shows
        return 1.0 + normal(n, scale=0.1)

    sd = {"model.embed_tokens.weight": normal(V, C, scale=C**-0.5), "model.norm.weight": norm_weight(C)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_weight(C)
        sd[p + "self_attn.q_proj.weight"] = linear(C, H * D)
        sd[p + "self_attn.k_proj.weight"] = linear(C, KV * D)
        sd[p + "self_attn.v_proj.weight"] = linear(C, KV * D)
        sd[p + "self_attn.o_proj.weight"] = linear(H * D, C)
        if config["model_type"] == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = norm_weight(D)
            sd[p + "self_attn.k_norm.weight"] = norm_weight(D)
        sd[p + "post_attention_layernorm.weight"] = norm_weight(C)
        sd[p + "mlp.gate_proj.weight"] = linear(C, F)
        sd[p + "mlp.up_proj.weight"] = linear(C, F)
        sd[p + "mlp.down_proj.weight"] = linear(F, C)
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = linear(C, V)
    return sd


def write_random_llama(out: Path, preset: str, seed: int = 0, tools: bool = False, **overrides) -> Path:
    """config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template (one that
    renders tools, with `tools`), generation_config.json."""
    config = make_llama_config(preset, **overrides)
    dtype = torch.bfloat16 if config["torch_dtype"] == "bfloat16" else torch.float32
    tensors = {k: v.to(dtype) for k, v in random_llama_state_dict(config, seed).items()}
    save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    family = LLAMA_CONFIGS[preset]["family"]
    tokenizer_size = LLAMA_CONFIGS[preset].get("tokenizer_size", config["vocab_size"])
    write_tokenizer(out, family, tokenizer_size, seed, config["max_position_embeddings"], tools)
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    if family == "qwen3":  # a Qwen3 reply ends with <|im_end|>; plain text with <|endoftext|>
        eos = [config["eos_token_id"], config["bos_token_id"]]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out
