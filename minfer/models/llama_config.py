"""Llama-family hyper-parameters (LlamaForCausalLM, Qwen3ForCausalLM), read from config.json.

Llama, SmolLM2, Qwen3 and their relatives are one architecture with a few switches:
Qwen3 adds an RMSNorm over each head's queries and keys (`qk_norm`), some models
tie the LM head to the embedding, some put biases on their projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import is_int
from .config import (
    architectures_of,
    is_positive_number,
    read_config_json,
    read_switch,
    require_positive_ints,
    require_positive_number,
)

# The architectures this config describes, and whether each normalises queries and keys per head.
QK_NORM = {"LlamaForCausalLM": False, "Qwen3ForCausalLM": True}
# What Llama 3's rope_scaling must give (llama.py's rope_frequencies reads each), as transformers requires too.
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# What transformers reads for a key config.json leaves out (LlamaConfig's and Qwen3Config's defaults). A null is
# refused (as transformers refuses it), but for num_key_value_heads, and Llama's head_dim, where null derives it.
DEFAULTS = {
    "LlamaForCausalLM": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
    },
    "Qwen3ForCausalLM": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
    },
}
# config.json's booleans, false where absent; transformers' Qwen3 has no MLP biases and no mlp_bias to read.
SWITCHES = {
    "LlamaForCausalLM": ("tie_word_embeddings", "attention_bias", "mlp_bias"),
    "Qwen3ForCausalLM": ("tie_word_embeddings", "attention_bias", "use_sliding_window"),
}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # C, the width of the residual stream
    intermediate_size: int  # the SwiGLU MLP's hidden width
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads, each shared by num_attention_heads // num_key_value_heads queries
    head_dim: int  # Qwen3 sets it apart from hidden_size // num_attention_heads
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or Llama 3's frequency rescaling ({"rope_type": "llama3", ...})
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on every head's queries and keys before RoPE
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        require_positive_ints(self, SIZES)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"config.json: rope_theta must be a number above 1, got {self.rope_theta!r}")
        require_positive_number(self, "rms_norm_eps")

    # The ModelConfig names, which the engine reads.
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_json(cls, path: str | Path) -> "LlamaConfig":
        """Read config.json (given it or its directory)."""
        return cls.from_raw(*read_config_json(path))

    @classmethod
    def from_raw(cls, path: Path, raw: dict) -> "LlamaConfig":
        """config.json's contents (`raw`, read from `path`); anything this implementation would silently get
        wrong is refused."""
        architecture = next((a for a in architectures_of(path, raw) if a in QK_NORM), None)
        if architecture is None:
            found = ", ".join(architectures_of(path, raw)) or raw.get("model_type") or "unknown"
            raise ValueError(f"{path} describes a {found!r} model, not one of {', '.join(QK_NORM)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (the Llama family uses silu)")
        layer_types = raw.get("layer_types") or []
        if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{path}: sliding-window attention (use_sliding_window, layer_types) is not supported")
        # transformers 5 moved rope_theta and rope_scaling into one rope_parameters dict.
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{path}: rope_parameters must be an object, got {rope!r}")
        scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise ValueError(f"{path}: rope_scaling {kind!r} is not supported (minfer supports none and 'llama3')")
            else:
                check_llama3_scaling(path, scaling)
        switches = {name: read_switch(path, raw, name) for name in SWITCHES[architecture]}
        defaults = DEFAULTS[architecture]
        fields = {name: raw.get(name, defaults.get(name)) for name in SIZES}
        heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
        if fields["num_key_value_heads"] is None:
            fields["num_key_value_heads"] = heads
        if architecture == "LlamaForCausalLM" and fields["head_dim"] is None:
            fields["head_dim"] = hidden // heads if is_int(hidden) and is_int(heads) and heads > 0 else None
        return cls(
            **fields,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            # rope_parameters' rope_theta wins over the top-level key (transformers 5 moved it there).
            rope_theta=rope["rope_theta"] if "rope_theta" in rope else raw.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=switches["tie_word_embeddings"],
            attention_bias=switches["attention_bias"],
            mlp_bias=switches.get("mlp_bias", False),
            qk_norm=QK_NORM[architecture],
            architecture=architecture,
        )


def check_llama3_scaling(path: Path, scaling: dict) -> None:
    """Llama 3's rope_scaling gives every number its frequencies are computed from."""
    lacking = [key for key in LLAMA3_SCALING if key not in scaling]
    if lacking:
        raise ValueError(f"{path}: rope_scaling 'llama3' needs {', '.join(lacking)}")
    for key in LLAMA3_SCALING:
        value = scaling[key]
        if not is_positive_number(value):
            raise ValueError(f"{path}: rope_scaling's {key} must be a positive number, got {value!r}")
