"""Which attention backend runs a model: chosen once, at load time, from the device and the config.

A new backend (FlexAttention, a Triton kernel with CUDA graphs) is one more entry in
ATTENTION_BACKENDS and, if it should be the default somewhere, one more line in
`backend_name`. Nothing in the models or the engine changes.
"""

from __future__ import annotations

import torch

from .compiled import CompiledBackend
from .cpu_tiled import CPUTiledBackend
from .paged import AttentionBackend
from .torch_sdpa import TorchBackend

# name -> (backend class, the device types it runs on; None: any)
ATTENTION_BACKENDS: dict[str, tuple[type, tuple[str, ...] | None]] = {
    "compiled": (CompiledBackend, ("cpu",)),
    "cpu_tiled": (CPUTiledBackend, ("cpu",)),
    "torch": (TorchBackend, None),
}
CHOICES = ("auto", "compiled", "eager")  # what users choose from (--attention-backend)


def backend_name(device: torch.device | str, choice: str = "auto", dtype: torch.dtype | None = None) -> str:
    """The backend a choice means on this device and cache dtype: "auto" is the compiled one on a CPU
    when the cache holds 16-bit floats (the engine falls back to eager if it cannot compile there),
    "eager" the device's eager one. An fp32 cache needs no upcast, and its eager read (a gather of
    whole rows, then sdpa) was 1.4-2.8x faster than the compiled loop in `bench.py --profile` decode
    steps on a Zen 4, where in bf16 the compiled one was 1.4-3.9x faster (docs/performance.md)."""
    device = torch.device(device)
    if choice == "auto":
        if device.type != "cpu":
            return "torch"
        return "cpu_tiled" if dtype == torch.float32 else "compiled"
    if choice == "eager":
        return "cpu_tiled" if device.type == "cpu" else "torch"
    return choice


def choose_attention_backend(device: torch.device | str, dtype: torch.dtype, name: str = "auto") -> AttentionBackend:
    """A fresh backend for a model on `device` in `dtype`: `name` (one of CHOICES, or a backend's own
    name). A fresh one each call: a backend may hold buffers it reuses step after step."""
    device = torch.device(device)
    name = backend_name(device, name, dtype)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(CHOICES)}, got {name!r}")
    backend_class, device_types = ATTENTION_BACKENDS[name]
    if device_types is not None and device.type not in device_types:
        raise ValueError(f"attention backend {name!r} runs on {' or '.join(device_types)} only, not on {device.type}")
    return backend_class(device, dtype)
