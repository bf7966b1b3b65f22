"""What this CPU is and can do, from what Linux reports: the engine and the attention selector choose
their paths from its flags (bf16 weights, packed linears, which attention backend); bench.py and the
model card name it."""

from __future__ import annotations

import platform
from functools import lru_cache


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 run bf16 matmuls in hardware; without them torch emulates bf16, slower than fp32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cpu_has_native_fp16() -> bool:
    """AVX512-FP16 or AMX-FP16 run fp16 arithmetic in hardware; elsewhere torch converts and emulates it."""
    return bool({"amx_fp16", "avx512_fp16"} & cpu_flags())


def cpu_has_amx() -> bool:
    """Intel's AMX tiles (Sapphire Rapids and later). Its hosts also read memory differently: there the
    eager fp32 context gather was the slow part of a decode step (attention/selector.py)."""
    return "amx_tile" in cpu_flags()


def cpu_has_int8_dot() -> bool:
    """int8 dot products in hardware (AVX512-VNNI, AVX-VNNI or AMX), which torch._int_mm's kernels use."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def cpu_name() -> str:
    """The CPU's model name, as lscpu prints it (else what the platform module knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
