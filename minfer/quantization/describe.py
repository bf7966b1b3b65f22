"""What a quantized model runs, told from the model itself: for /health, the server's banner and the compile choice.

The flags are not enough: a `minfer quantize` checkpoint is quantized without --quantization, its group size and
LM head were chosen when it was written, and int4's default group size is left unset in the flags. And a packed
int4 matrix holds two weights a byte, so counting its elements counts half the weights it stands for.
"""

from __future__ import annotations

from torch import nn

from ..engine.config import dtype_name
from .int4 import Int4Linear
from .int8 import Int8Linear
from .linear import QuantizedLinear
from .transform import quantization_of


def num_parameters(model: nn.Module) -> int:
    """The parameters `model` stands for: a quantized matrix counts as the float one it replaced (out x in, and its
    bias), however its weights are packed; a matrix shared by a tied embedding and head counts once."""
    quantized = {id(m): m for m in model.modules() if isinstance(m, QuantizedLinear)}.values()
    packed = {id(p) for m in quantized for p in m.parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in packed)
    return rest + sum(m.out_features * m.in_features + (m.bias.numel() if m.bias is not None else 0) for m in quantized)


def running_quantization(model: nn.Module) -> dict:
    """EngineConfig's quantization fields as `model` runs them: the method, int4's group size, whether the LM head
    is quantized and whether int8 rounds its activations too. An unquantized model gives the fields' defaults."""
    method = quantization_of(model)
    if method is None:
        return {"quantization": None, "quantization_group_size": None, "quantize_lm_head": True,
                "quantize_activations": False}
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    return {
        "quantization": method,
        "quantization_group_size": next((m.group_size for m in linears if isinstance(m, Int4Linear)), None),
        "quantize_lm_head": isinstance(getattr(model, "lm_head", None), QuantizedLinear),
        "quantize_activations": any(isinstance(m, Int8Linear) and m.quantize_activations for m in linears),
    }


def describe_quantization(model: nn.Module) -> str | None:
    """One line for the server's banner, e.g. "int4 weights in groups of 64, the LM head too: 79.0 MB of weights";
    None for an unquantized model."""
    ran = running_quantization(model)
    if ran["quantization"] is None:
        return None
    what = f"{ran['quantization']} weights"
    if ran["quantization_group_size"] is not None:
        what += f" in groups of {ran['quantization_group_size']}"
    what += ", the LM head too" if ran["quantize_lm_head"] else f", the LM head in {dtype_name(model.dtype)}"
    if ran["quantize_activations"]:
        what += ", int8 activations"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return f"{what}: {weight_bytes / 1e6:.1f} MB of weights"
