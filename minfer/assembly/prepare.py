"""prepare_model: the one step between a loaded model and the one the engine runs.

Model files stay plain (nanoGPT-like: nn.Linear, one readable forward) and never import
what transforms them. Everything that makes a model fast on the machine at hand happens
here, once, after loading, and is chosen from the device and the config:
- on a CPU, prepacked linears and LM head, or bf16 kept as storage only (cpu_packing.py);
- the attention backend (attention/selector.py): on a CPU in bf16 the compiled one, warmed up and
  checked against eager here (or the tiled eager one, with one log line saying why); plain
  torch elsewhere. `enforce_eager` (or attention_backend="eager") keeps everything eager.
- weight-only int8/int4 (config.quantization, quantization/): every linear, the LM head and the
  token embedding, before the CPU packing (which then packs what is left in full precision).
A compiled decode step (config.compile_decode_step) wraps the prepared model in the runner
(compiled_step.py); CUDA graphs will go there too. Each is a transform or a backend, never an edit
to a model file.

Preparing is idempotent: a model prepared twice is the model prepared once (tests and
benchmarks reuse a loaded model across engines), and each call returns a fresh backend.
"""

from __future__ import annotations

import logging

import torch

from ..attention.paged import AttentionBackend
from .selector import choose_attention_backend
from ..quantization import QuantizedLinear, quantize_model
from ..engine.config import EngineConfig
from ..cpu.packing import optimize_for_cpu

log = logging.getLogger("minfer")


def prepare_model(model: torch.nn.Module, config=None) -> tuple[torch.nn.Module, AttentionBackend]:
    """Make `model` (any models.CausalLM) ready to run, in place, and choose its attention backend.
    `config` is an EngineConfig or anything with its fields; a missing one keeps EngineConfig's
    default (attention_backend: $MINFER_ATTENTION_BACKEND, else "auto": the best for the device)."""
    method = getattr(config, "quantization", None)
    if method is not None:
        quantize_model(
            model, method, getattr(config, "quantization_group_size", None), getattr(config, "quantize_lm_head", True),
            getattr(config, "quantize_activations", False),
        )
    if model.device.type == "cpu":
        # Swaps nn.Linear for faster equivalents; a prepared model has none left. A whole-forward graph
        # (--compile-model) packs its frozen weights for Inductor's own GEMMs: they stay plain for it.
        whole_graph = getattr(config, "compile_model", False)
        optimize_for_cpu(model, pack=not whole_graph)
        if whole_graph:
            for linear in model.modules():
                if isinstance(linear, QuantizedLinear):
                    linear.kernel_when_compiled = True  # Inductor's template serves every row count
    choice = "eager" if getattr(config, "enforce_eager", False) else getattr(config, "attention_backend", None)
    choice = choice or EngineConfig.attention_backend
    c = model.config
    backend = choose_attention_backend(model.device, model.dtype, choice, kv_width=c.num_kv_heads * c.head_dim)
    warm_up = getattr(backend, "warm_up", None)
    if warm_up is not None:
        block_size = getattr(config, "block_size", None) or EngineConfig.block_size
        why_not = warm_up(c.num_heads, c.num_kv_heads, c.head_dim, block_size)
        if why_not:
            log.warning("minfer: compiled attention is off, running eager attention instead: %s", why_not)
            backend = choose_attention_backend(model.device, model.dtype, "eager")
    if getattr(config, "compile_model", False) and hasattr(backend, "lone_decode_in_graph"):
        backend.lone_decode_in_graph = True  # a lone sequence's decode attention traced into its graph (compiled.py)
    return model, backend
