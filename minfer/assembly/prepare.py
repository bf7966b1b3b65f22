"""prepare_model: the one step between a loaded model and the one the engine runs.

Model files stay plain (nanoGPT-like: nn.Linear, one readable forward) and never import
what transforms them. Everything that makes a model fast on the machine at hand happens
here, once, after loading, and is chosen from the device and the config:
- weight-only int8/int4 (config.quantization, quantization/): every linear, the LM head and the
  token embedding, before the CPU packing (which then packs what is left in full precision);
- on a CPU, prepacked linears and LM head, or bf16 kept as storage only (cpu/linears.py);
- the attention backend (selector.py): on a CPU in bf16 the compiled one, warmed up and
  checked against eager here (or the tiled eager one, with one log line saying why); plain
  torch elsewhere. `enforce_eager` (or attention_backend="eager") keeps everything eager.
A compiled decode step and CUDA graphs run the prepared model (compiled/forward.py). Each is a
transform or a backend, never an edit to a model file.

Preparing is idempotent: a model prepared twice is the model prepared once (tests and
benchmarks reuse a loaded model across engines), and each call returns a fresh backend.
"""

from __future__ import annotations

import logging

import torch

from ..attention.backend import AttentionBackend
from ..cpu.linears import optimize_for_cpu
from ..engine.config import EngineConfig
from ..models.contract import mark_prepared
from ..quantization import QuantizedLinear, quantize_model
from .selector import choose_attention_backend

log = logging.getLogger("minfer")


def prepare_model(model: torch.nn.Module,
                  config: EngineConfig | None = None) -> tuple[torch.nn.Module, AttentionBackend]:
    """Make `model` (any models.CausalLM) ready to run, in place, and choose its attention backend."""
    config = config or EngineConfig()
    if config.quantization is not None:
        quantize_model(
            model, config.quantization, config.quantization_group_size, config.quantize_lm_head,
            config.quantize_activations,
        )
    if model.device.type == "cpu":
        # Swaps nn.Linear for faster equivalents; a prepared model has none left. A whole-forward graph
        # (--compile-model) packs its frozen weights for Inductor's own GEMMs: they stay plain for it.
        optimize_for_cpu(model, pack=not config.compile_model)
        if config.compile_model:
            for linear in model.modules():
                if isinstance(linear, QuantizedLinear):
                    linear.kernel_when_compiled = True  # Inductor's template serves every row count
    mark_prepared(model)  # quantized now or never (quantization/transform.py)
    return model, attention_for(model, config)


def attention_for(model: torch.nn.Module, config: EngineConfig) -> AttentionBackend:
    """The attention backend config asks for on model's device and dtype, warmed up; the eager one if its
    warm-up fails (one log line says why)."""
    choice = "eager" if config.enforce_eager else config.attention_backend
    c = model.config
    backend = choose_attention_backend(model.device, model.dtype, choice, kv_width=c.num_kv_heads * c.head_dim)
    why_not = backend.warm_up(c.num_heads, c.num_kv_heads, c.head_dim, config.block_size)
    if why_not:
        log.warning("minfer: compiled attention is off, running eager attention instead: %s", why_not)
        backend = choose_attention_backend(model.device, model.dtype, "eager")
    if config.compile_model:
        backend.lone_decode_in_graph = backend.traces_lone_decode  # its decode traced into the graph
    return backend
