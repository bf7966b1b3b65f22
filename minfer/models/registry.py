"""Which model a checkpoint holds: config.json's `architectures` picks the class.

The engine never asks which model it runs: every class here is a contract.Architecture
(it names its checkpoint's tensors, so loader.from_pretrained builds it) whose models are
contract.CausalLM (one flat forward per engine step, `.config`, `.device`, `.dtype`,
`.lm_head`, `.model_dir`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..model_config import ModelConfig
from .config import architectures_of, read_config_json
from .contract import Architecture, CausalLM
from .gpt2 import GPT2
from .llama import Llama
from .loader import WeightLoader, from_pretrained, resolve_model_dir

# architecture name in config.json -> the model class (its config class is model_class.config_class)
ARCHITECTURES: dict[str, Architecture] = {
    "GPT2LMHeadModel": GPT2,
    "Qwen3ForCausalLM": Llama,
    "LlamaForCausalLM": Llama,
}
# Configs without `architectures` (older exports) still name their model_type.
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def architecture(path: Path, raw: dict) -> str:
    """The supported architecture config.json (`raw`, read from `path`) names, or a ValueError saying what is
    supported."""
    names = architectures_of(path, raw)
    for name in names:
        if name in ARCHITECTURES:
            return name
    if not names and raw.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[raw["model_type"]]
    found = ", ".join(names) or raw.get("model_type") or "unknown"
    raise ValueError(f"{path} describes a {found!r} model; minfer runs these architectures: {', '.join(ARCHITECTURES)}")


def config_of(path: Path, raw: dict) -> ModelConfig:
    """The config that config.json (`raw`, read from `path`) describes, as the class its architecture uses."""
    return ARCHITECTURES[architecture(path, raw)].config_class.from_raw(path, raw)


def read_config(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's config, as the class its architecture uses."""
    return config_of(*read_config_json(model_dir))


def load_model(
    name_or_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: WeightLoader | None = None,
    config_json: tuple[Path, dict] | None = None,
) -> CausalLM:
    """Load any supported checkpoint (local directory or Hub repo id) as the model its config names;
    `weights` loads them its own way where it says so (quantization/checkpoint.py: QuantizedWeights).
    `config_json`: read_config_json's (path, contents) of its config.json, where the caller read it already."""
    model_dir = resolve_model_dir(name_or_path)
    config_json = config_json or read_config_json(model_dir)
    return from_pretrained(ARCHITECTURES[architecture(*config_json)], model_dir, device, dtype, weights, config_json)
