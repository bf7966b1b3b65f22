"""Weight-only int8 and int4 quantization on the CPU, through torch's own kernels.

At batch 1 a decode step reads every weight once: its time is the weight bytes over memory
bandwidth. int8 halves bf16's bytes, int4 quarters them. Layers (docs/architecture.md): below
models, above attention; the engine's prepare_model applies `quantize_model` after loading.

- int8.py: symmetric per-output-channel int8, `Int8Linear` (aten._weight_int8pack_mm)
- int4.py: group-wise int4 in torch's int4pack layout, `Int4Linear` (aten._weight_int4pack_mm_for_cpu)
- linear.py: what both share: the kernel for a few rows, dequantize + GEMM for batches
- embedding.py: the token embedding read from a quantized (tied) matrix
- transform.py: `quantize_model`, `check_quantization`
- describe.py: what a quantized model runs (/health, the banner) and the parameters it stands for
- checkpoint.py: quantizing while loading, and the on-disk format `minfer quantize` writes (quantized
  tensors, scales, config.json's quantization_config); other formats (GPTQ, AWQ) are refused
"""

from .describe import describe_quantization, num_parameters, running_quantization
from .embedding import QuantizedEmbedding
from ..engine.config import GROUP_SIZES, QUANTIZATION_METHODS
from .int4 import DEFAULT_GROUP_SIZE, Int4Linear, int4_kernel_available, quantize_int4
from .int8 import Int8Linear, quantize_int8
from .linear import QuantizedLinear
from .transform import check_quantization, quantization_of, quantize_model

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "GROUP_SIZES",
    "QUANTIZATION_METHODS",
    "Int4Linear",
    "Int8Linear",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "check_quantization",
    "describe_quantization",
    "int4_kernel_available",
    "num_parameters",
    "quantization_of",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "running_quantization",
]
