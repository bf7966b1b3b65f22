"""Model hyper-parameters, read from a checkpoint's config.json.

Every member of the GPT-2 family (gpt2, gpt2-medium, gpt2-large, gpt2-xl,
distilgpt2) is the same architecture with different numbers in GPT2Config;
llama_config.py holds the Llama family's (Llama, Qwen3). The engine reads only
the facts of `ModelConfig` (minfer/model_config.py), which both provide, so it runs
either model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import is_int


def read_config_json(path: str | Path) -> tuple[Path, dict]:
    """config.json's path (given it or its directory) and its contents, or one clear error."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json found at {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return path, raw


def architectures_of(path: Path, raw: dict) -> list[str]:
    """config.json's `architectures`: the model classes it names (none where it names none)."""
    names = raw.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"{path}: architectures must be a list of class names, got {names!r}")
    return names


def read_switch(path: Path, raw: dict, name: str, default: bool = False) -> bool:
    """A true/false key of config.json: the default where absent; anything else, null too, refused (as transformers
    refuses it)."""
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{path}: {name} must be true or false, got {value!r}")
    return value


def require_positive_ints(config, names) -> None:
    """Every named field of a config read from config.json must be a positive int."""
    for name in names:
        value = getattr(config, name)
        if not is_int(value) or value <= 0:
            raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")


def is_positive_number(value) -> bool:
    """A finite number above 0, as JSON writes one (true is no number)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def require_positive_number(config, name: str) -> None:
    """A field of a config read from config.json that must be a positive number (an epsilon)."""
    value = getattr(config, name)
    if not is_positive_number(value):
        raise ValueError(f"config.json: {name} must be a positive number, got {value!r}")


# GPT-2's "gelu_new" is GELU with the tanh approximation; "gelu" is the exact erf form.
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu")


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024  # longest context the position embedding covers
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    tie_word_embeddings: bool = True  # the LM head is the token embedding (true where config.json does not say)
    # The EOS id is the tokenizer's business (Tokenizer.eos_token_id reads config.json for it).

    def __post_init__(self):
        require_positive_ints(self, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"))
        if self.n_inner is not None and (not is_int(self.n_inner) or self.n_inner <= 0):
            raise ValueError(
                f"config.json: n_inner must be a positive integer, or null for 4 * n_embd, got {self.n_inner!r}"
            )
        require_positive_number(self, "layer_norm_epsilon")
        if self.n_embd % self.n_head:
            raise ValueError(f"config.json: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation_function not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"config.json: activation_function {self.activation_function!r} is not supported "
                f"(GPT-2 uses one of {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        if not isinstance(self.tie_word_embeddings, bool):
            tied = self.tie_word_embeddings
            raise ValueError(f"config.json: tie_word_embeddings must be true or false, got {tied!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_dim(self) -> int:
        return self.n_inner or 4 * self.n_embd

    # The ModelConfig names, which the engine reads.
    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def num_heads(self) -> int:
        return self.n_head

    @property
    def num_kv_heads(self) -> int:
        return self.n_head  # GPT-2 keeps keys and values for every head

    @property
    def max_positions(self) -> int:
        return self.n_positions

    @classmethod
    def from_json(cls, path: str | Path) -> "GPT2Config":
        """Read config.json (given it or its directory)."""
        return cls.from_raw(*read_config_json(path))

    @classmethod
    def from_raw(cls, path: Path, raw: dict) -> "GPT2Config":
        """config.json's contents (`raw`, read from `path`); checkpoints of other architectures refused in one
        sentence."""
        model_type = raw.get("model_type")
        architectures = architectures_of(path, raw)
        if model_type != "gpt2" and not any(str(a).startswith("GPT2") for a in architectures):
            found = model_type or ", ".join(map(str, architectures)) or "unknown"
            raise ValueError(
                f"{path} describes a {found!r} model, not GPT-2 (model_type 'gpt2'); "
                f"minfer.models.load_model picks the model class a checkpoint needs"
            )
        unsupported = [
            key
            for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
            if read_switch(path, raw, key)
        ]
        if not read_switch(path, raw, "scale_attn_weights", default=True):
            unsupported.append("scale_attn_weights=false")
        if unsupported:
            raise ValueError(f"{path}: GPT-2 variant options not supported by minfer: {', '.join(unsupported)}")
        fields = {
            "vocab_size": raw.get("vocab_size", cls.vocab_size),
            "n_positions": raw.get("n_positions", cls.n_positions),  # n_ctx is not read (transformers ignores it)
            "n_embd": raw.get("n_embd", cls.n_embd),
            "n_layer": raw.get("n_layer", cls.n_layer),
            "n_head": raw.get("n_head", cls.n_head),
            "n_inner": raw.get("n_inner"),
            "layer_norm_epsilon": raw.get("layer_norm_epsilon", cls.layer_norm_epsilon),
            "activation_function": raw.get("activation_function", cls.activation_function),
            "tie_word_embeddings": raw.get("tie_word_embeddings", cls.tie_word_embeddings),
        }
        return cls(**fields)
