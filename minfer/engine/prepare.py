"""prepare_model: the one step between a loaded model and the one the engine runs.

Model files stay plain (nanoGPT-like: nn.Linear, one readable forward) and never import
what transforms them. Everything that makes a model fast on the machine at hand happens
here, once, after loading, and is chosen from the device and the config:
- on a CPU, prepacked linears and LM head, or bf16 kept as storage only (cpu_packing.py);
- the attention backend (attention/selector.py): the CPU's tiled eager one, or plain torch.
Later: quantized linears (config.quantization), compiled regions and CUDA graphs (unless
config.enforce_eager); each is a transform or a backend, never an edit to a model file.

Preparing is idempotent: a model prepared twice is the model prepared once (tests and
benchmarks reuse a loaded model across engines), and each call returns a fresh backend.
"""

from __future__ import annotations

import torch

from ..attention.paged import AttentionBackend
from ..attention.selector import choose_attention_backend
from .cpu_packing import optimize_for_cpu


def prepare_model(model: torch.nn.Module, config=None) -> tuple[torch.nn.Module, AttentionBackend]:
    """Make `model` (any models.CausalLM) ready to run, in place, and choose its attention backend.
    `config` is an EngineConfig or anything with its fields; a missing one keeps its default
    (attention_backend "auto": the best backend for the model's device)."""
    if model.device.type == "cpu":
        optimize_for_cpu(model)  # swaps nn.Linear for faster equivalents; a prepared model has none left
    name = getattr(config, "attention_backend", None) or "auto"
    return model, choose_attention_backend(model.device, model.dtype, name)
