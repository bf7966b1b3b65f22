"""A GPT-2 checkpoint with random weights, in either tensor-name layout found in the wild."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .files import save_safetensors
from .tokenizer_training import EOS_TOKEN, train_tokenizer

CONFIGS = {
    # The shape of openai-community/gpt2 (124M parameters).
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    # Small enough that a test runs in milliseconds.
    "tiny": dict(vocab_size=512, n_positions=512, n_embd=64, n_layer=2, n_head=4),
}
LAYOUTS = ("hub", "transformers")


def make_config(preset: str = "tiny", **overrides) -> dict:
    """A config.json dict in the format transformers writes for GPT-2."""
    if preset not in CONFIGS:
        raise ValueError(f"unknown config preset {preset!r}; choose one of {sorted(CONFIGS)}")
    shape = {**CONFIGS[preset], **overrides}
    if shape["n_embd"] % shape["n_head"]:
        raise ValueError(f"n_embd ({shape['n_embd']}) must be divisible by n_head ({shape['n_head']})")
    embedding_std = shape.pop("initializer_range", 0.02)
    tied = shape.pop("tie_word_embeddings", True)  # false: the checkpoint stores an LM head of its own
    eos = shape["vocab_size"] - 1  # like GPT-2, <|endoftext|> is the last id
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **shape,
        "n_ctx": shape["n_positions"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": embedding_std,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "tie_word_embeddings": tied,
    }


def random_state_dict(config: dict, layout: str = "hub", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under GPT-2's own tensor names (Conv1D weights are [in, out])."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    g = torch.Generator().manual_seed(seed)
    C, V, P = config["n_embd"], config["vocab_size"], config["n_positions"]
    hidden = config.get("n_inner") or 4 * C
    std = config.get("initializer_range", 0.02)  # embeddings; linear layers scale by fan-in

    def normal(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    def linear(fan_in, fan_out):  # O(1) outputs, so each block really changes the residual stream
        return normal(fan_in, fan_out, scale=fan_in**-0.5), normal(fan_out)

    def norm_weight():  # near 1, but not exactly, so a mix-up of weight and bias shows
        return 1.0 + normal(C, scale=0.1)

    sd = {"wte.weight": normal(V, C), "wpe.weight": normal(P, C, scale=0.01)}
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = norm_weight(), normal(C)
        sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"] = linear(C, 3 * C)
        sd[p + "attn.c_proj.weight"], sd[p + "attn.c_proj.bias"] = linear(C, C)
        sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = norm_weight(), normal(C)
        sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = linear(C, hidden)
        sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = linear(hidden, C)
        if layout == "hub":
            # The Hub's gpt2 file carries the causal mask as a buffer; loaders must skip it.
            sd[p + "attn.bias"] = torch.tril(torch.ones(P, P)).view(1, 1, P, P)
    sd["ln_f.weight"], sd["ln_f.bias"] = norm_weight(), normal(C)
    if layout == "transformers":
        sd = {"transformer." + k: v for k, v in sd.items()}
    if not config.get("tie_word_embeddings", True):
        sd["lm_head.weight"] = normal(V, C)  # nn.Linear's [out, in], outside `transformer.` in either layout
    return sd


def write_random_gpt2(out: Path, preset: str = "tiny", layout: str = "hub", seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer.json (+ tokenizer_config.json) to out."""
    config = make_config(preset, **overrides)
    tensors = random_state_dict(config, layout, seed)
    save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    train_tokenizer(config["vocab_size"], seed).save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": config["n_positions"],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out
