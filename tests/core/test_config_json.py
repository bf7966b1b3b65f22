"""config.json is read as transformers reads it: a key left out takes transformers' default for the architecture, a
null takes it where transformers does and is refused, naming the key, where transformers fails on it."""

import json

import pytest
import torch

from minfer.models.config import GPT2Config
from minfer.models.llama_config import SIZES
from minfer.models.registry import read_config

transformers = pytest.importorskip("transformers")

LLAMA_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "hidden_act",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
]
QWEN3_KEYS = LLAMA_KEYS + ["use_sliding_window", "layer_types"]
GPT2_KEYS = [
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_inner",
    "layer_norm_epsilon",
    "activation_function",
    "tie_word_embeddings",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    "add_cross_attention",
]
LLAMA_FACTS = [*SIZES, "rms_norm_eps", "tie_word_embeddings"]
GPT2_FACTS = ["vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon",
              "activation_function", "tie_word_embeddings"]
# Qwen3Config's 32 key/value heads where config.json gives none need more than the tiny model's 4 query heads.
WITH_ABSENT = {("qwen3-tiny", "num_key_value_heads"): {"num_attention_heads": 64}}
# rope_theta at the top level and in transformers 5's rope_parameters: the latter wins. Qwen3 has no MLP biases.
MORE_EDITS = {
    "top-level null, rope_parameters' 5e5": (
        "llama-tiny",
        {"rope_theta": None, "rope_parameters": {"rope_theta": 5e5}},
    ),
    "top-level 1e3, rope_parameters' 2e3": (
        "llama-tiny",
        {"rope_theta": 1e3, "rope_parameters": {"rope_theta": 2e3}},
    ),
    "top-level 5e5, rope_parameters' null": (
        "llama-tiny",
        {"rope_theta": 5e5, "rope_parameters": {"rope_theta": None}},
    ),
    "top-level 7e3, no rope_parameters' rope_theta": ("llama-tiny", {"rope_theta": 7e3, "rope_parameters": {}}),
    "mlp_bias true": ("qwen3-tiny", {"mlp_bias": True}),
}


def edits():
    for preset, keys in (("llama-tiny", LLAMA_KEYS), ("qwen3-tiny", QWEN3_KEYS), ("tiny", GPT2_KEYS)):
        for key in keys:
            yield pytest.param(preset, key, {key: None}, id=f"{preset}-{key}-null")
            absent = {key: "absent"} | WITH_ABSENT.get((preset, key), {})
            yield pytest.param(preset, key, absent, id=f"{preset}-{key}-absent")
    for name, (preset, edit) in MORE_EDITS.items():
        yield pytest.param(preset, next(iter(edit)), edit, id=f"{preset}-{name}")


def transformers_reads(model_dir):
    """The facts transformers' model is built from, or None where it refuses the config or fails to build on it."""
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:
        return None
    if config.model_type == "gpt2":
        return {fact: getattr(config, fact) for fact in GPT2_FACTS}
    mlp = model.model.layers[0].mlp.gate_proj
    return {fact: getattr(config, fact) for fact in LLAMA_FACTS} | {
        "rope_theta": config.rope_parameters["rope_theta"],
        "attention_bias": model.model.layers[0].self_attn.q_proj.bias is not None,
        "mlp_bias": mlp.bias is not None,
    }


def minfer_reads(model_dir, key):
    """The same facts as minfer reads them, or None where it refuses, naming the key."""
    try:
        config = read_config(model_dir)
    except ValueError as e:
        assert key in str(e), str(e)
        return None
    if isinstance(config, GPT2Config):
        return {fact: getattr(config, fact) for fact in GPT2_FACTS}
    return {fact: getattr(config, fact) for fact in LLAMA_FACTS + ["rope_theta", "attention_bias", "mlp_bias"]}


@pytest.mark.parametrize("preset, key, edit", edits())
def test_null_and_absent_keys_read_as_transformers_reads_them(make_checkpoint, tmp_path, preset, key, edit):
    raw = json.loads((make_checkpoint(preset) / "config.json").read_text())
    raw.setdefault("architectures", ["GPT2LMHeadModel"])
    for name, value in edit.items():
        raw.pop(name, None)
        if value != "absent":
            raw[name] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    expected = transformers_reads(tmp_path)
    assert minfer_reads(tmp_path, key) == expected
