"""Which attention backend runs a model: chosen once, at load time, from the device and the config.

A new backend is one more entry in ATTENTION_BACKENDS and, if it should be the default
somewhere, one more line in `backend_name`. Nothing in the models or the engine changes.
"""

from __future__ import annotations

import torch

from ..cpu.features import cpu_has_amx
from ..compiled.attention import CompiledBackend
from ..cpu.tiled_attention import CPUTiledBackend
from ..compiled.flex import FlexBackend
from ..attention.backend import AttentionBackend
from ..attention.torch_sdpa import TorchBackend

# name -> (backend class, the device types it runs on; None: any)
ATTENTION_BACKENDS: dict[str, tuple[type, tuple[str, ...] | None]] = {
    "compiled": (CompiledBackend, ("cpu",)),
    "cpu_tiled": (CPUTiledBackend, ("cpu",)),
    "flex": (FlexBackend, None),  # any device; chosen by name on a CPU (the tests), by default on a GPU
    "torch": (TorchBackend, None),
}
CHOICES = ("auto", "compiled", "eager")  # what users choose from (--attention-backend)
# Below this K/V width (kv heads x head dim) a CPU runs the plain backend whatever was asked: each compiled
# call costs ~0.1 ms before any work, more than it saves on a narrow cache (minfer-tiny, width 128: 13.9 ms
# per decode step compiled against 9.8 eager; GPT-2 124M, 768: 1.4-3.9x faster compiled), and the tiled read
# pays for its tiles only on wide contexts (minfer-tiny, fp32, Zen 3, 64 x (128 + 128): plain 2887-3142 tok/s
# at 16 streams and 2.5-2.8 ms/token alone, tiled 2559-2877 and 2.8-2.9). Widths in between are unmeasured:
# 512 splits them.
MIN_CPU_KV_WIDTH = 512


def backend_name(
    device: torch.device | str, dtype: torch.dtype, choice: str = "auto", kv_width: int | None = None
) -> str:
    """The backend a choice means on this device and cache dtype. On a CPU a narrow cache (below
    MIN_CPU_KV_WIDTH) runs the plain one; a wider one takes the compiled backend for "auto" when the
    cache holds 16-bit floats, or fp32 on a CPU with AMX (the engine falls back to eager if it cannot
    compile there), and the tiled eager one otherwise. An fp32 cache needs no upcast: on a Zen 4 its
    eager read (a gather of whole rows, then sdpa) and the compiled one took the same time in `bench.py
    --profile` decode steps, so there the compile would only add start-up time; on an AVX2-only Zen 3
    compiled fp32 attention took 22% less time, 1.07x at 64 sequences and even at one, not worth a
    first start's 18 s of compiling. On an Intel host with AMX the eager gather ran at half that speed
    and compiled fp32 steps were 1.2-1.4x faster (docs/performance.md). float64 (a reference precision)
    stays eager. On a GPU "auto" and "compiled" are FlexAttention over the block tables (flex.py),
    "eager" the plain backend."""
    device = torch.device(device)
    if device.type != "cpu":
        return "flex" if choice in ("auto", "compiled") else "torch" if choice == "eager" else choice
    if choice in ("auto", "eager") and kv_width is not None and kv_width < MIN_CPU_KV_WIDTH:
        return "torch"
    if choice == "auto":
        sixteen_bit = dtype in (torch.bfloat16, torch.float16)
        fp32_on_amx = dtype == torch.float32 and cpu_has_amx()
        return "compiled" if sixteen_bit or fp32_on_amx else "cpu_tiled"
    if choice == "eager":
        return "cpu_tiled"
    return choice


def choose_attention_backend(
    device: torch.device | str, dtype: torch.dtype, name: str = "auto", kv_width: int | None = None
) -> AttentionBackend:
    """A fresh backend for a model on `device` in `dtype` whose K/V rows are `kv_width` wide: `name`
    (one of CHOICES, or a backend's own name). A fresh one each call: a backend may hold buffers it
    reuses step after step."""
    device = torch.device(device)
    name = backend_name(device, dtype, name, kv_width)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(CHOICES)}, got {name!r}")
    backend_class, device_types = ATTENTION_BACKENDS[name]
    if device_types is not None and device.type not in device_types:
        raise ValueError(f"attention backend {name!r} runs on {' or '.join(device_types)} only, not on {device.type}")
    return backend_class(device, dtype)
