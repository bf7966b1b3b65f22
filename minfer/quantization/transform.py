"""quantize_model: swap a loaded model's linears, LM head and token embedding for quantized ones, in place.

The gpt-fast way: the model file stays plain nn.Linear / nn.Embedding and never knows; the engine's
prepare_model calls this after loading. What it covers, as llama.cpp's Q8_0 / Q4_0 do: every
linear of every block, the LM head, and the token embedding (shared with a tied head, see
embedding.py). Norms, biases and GPT-2's position table stay in full precision: they are small.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..models.contract import is_prepared
from ..engine.config import GROUP_SIZES, check_quantization_flags
from .embedding import QuantizedEmbedding
from .int4 import DEFAULT_GROUP_SIZE, Int4Linear, int4_kernel_available
from .int8 import HAS_INT8_DOT, Int8Linear
from .linear import QuantizedLinear

log = logging.getLogger("minfer")


def check_quantization(method: str | None, group_size: int | None = None, quantize_lm_head: bool = True,
                       quantize_activations: bool = False) -> None:
    """ValueError with a sentence for quantization flags minfer would not apply (engine/config.py's rule), or a
    group size or method it cannot run here (before any loading)."""
    check_quantization_flags(method, group_size, quantize_lm_head, quantize_activations)
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"--quantization-group-size must be one of {GROUP_SIZES}, got {group_size!r}")
    if method == "int4" and not int4_kernel_available():
        raise ValueError(
            f"--quantization int4 needs torch's CPU int4 kernels (torch >= 2.6); this torch ({torch.__version__}) "
            "has none that run here: use --quantization int8"
        )


def quantized_linear(linear: nn.Linear, method: str, group_size: int | None = None) -> QuantizedLinear:
    if method == "int8":
        return Int8Linear.from_float(linear)
    return Int4Linear.from_float(linear, group_size or DEFAULT_GROUP_SIZE)


def quantization_of(model: nn.Module) -> str | None:
    """"int8" or "int4" if `model` has been quantized, else None."""
    for m in model.modules():
        if isinstance(m, Int8Linear):
            return "int8"
        if isinstance(m, Int4Linear):
            return "int4"
    return None


def find_token_embedding(model: nn.Module, head: nn.Linear | None) -> tuple[nn.Module, str, nn.Embedding] | None:
    """(parent, name, module) of the token embedding: the one tied to the head, else the first with a row
    per token (GPT-2's position table may have as many rows: it comes second)."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Embedding and child.num_embeddings == model.config.vocab_size
    ]
    tied = [entry for entry in found if head is not None and entry[2].weight is head.weight]
    return (tied or found or [None])[0]


def quantize_model(
    model: nn.Module, method: str, group_size: int | None = None, quantize_lm_head: bool = True,
    quantize_activations: bool = False,
) -> nn.Module:
    """Quantize `model` (a models.CausalLM) in place and return it. `quantize_lm_head=False` keeps the
    LM head and the token embedding (tied to it or not) in full precision. `quantize_activations` (int8 only) rounds
    each linear's input rows to int8 too, for int8 x int8 matmuls (int8.py). Quantizing a quantized
    model again with the same method changes nothing but that choice."""
    check_quantization(method, group_size, quantize_lm_head, quantize_activations)
    _quantize_weights(model, method, group_size, quantize_lm_head)
    if quantize_activations and not HAS_INT8_DOT:
        log.warning("minfer: --quantize-activations on a CPU without int8 dot products (VNNI, AMX): no faster than "
                    "weight-only int8 here, and one row at a time (batch-1 decode) ~3x slower")
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.quantize_activations = quantize_activations
    return model


def _quantize_weights(model: nn.Module, method: str, group_size: int | None, quantize_lm_head: bool) -> nn.Module:
    if model.device.type != "cpu":  # the seam for the GPU issue: CUDA kernels go here
        raise ValueError(f"--quantization {method} runs on the CPU only for now, not on {model.device}")
    done = quantization_of(model)
    if done is not None:
        if done != method:
            raise ValueError(f"this model is already quantized to {done}; load it again to quantize it to {method}")
        return model
    if is_prepared(model) or not any(type(m) is nn.Linear for m in model.modules()):
        raise ValueError("this model was prepared without quantization already; load it again to quantize it")
    dtype = model.dtype  # the activations' dtype, before the embedding that tells it is replaced
    head = getattr(model, "lm_head", None)
    head = head if type(head) is nn.Linear else None
    token_embedding = find_token_embedding(model, head)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not head:
                setattr(parent, name, quantized_linear(child, method, group_size))  # the float one is freed
    if head is None or not quantize_lm_head:
        return model
    quantized_head = quantized_linear(head, method, group_size)
    model.lm_head = quantized_head
    if token_embedding is not None:
        parent, name, embedding = token_embedding
        if embedding.weight is head.weight:  # tied: the lookup reads the head's quantized rows
            table = quantized_head
        else:  # a table of its own, quantized the same way
            as_linear = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
            as_linear.weight = embedding.weight
            table = quantized_linear(as_linear, method, group_size)
        setattr(parent, name, QuantizedEmbedding(table, dtype))
    return model
