"""Which attention backend runs a model: chosen once, at load time, from the device and the config.

A new backend (torch.compile'd, FlexAttention, a Triton kernel with CUDA graphs) is one
more entry in ATTENTION_BACKENDS and, if it should be the default somewhere, one more
line in `choose_attention_backend`. Nothing in the models or the engine changes.
"""

from __future__ import annotations

import torch

from .cpu_tiled import CPUTiledBackend
from .paged import AttentionBackend
from .torch_sdpa import TorchBackend

# name -> (backend class, the device types it runs on; None: any)
ATTENTION_BACKENDS: dict[str, tuple[type, tuple[str, ...] | None]] = {
    "cpu_tiled": (CPUTiledBackend, ("cpu",)),
    "torch": (TorchBackend, None),
}


def choose_attention_backend(device: torch.device | str, dtype: torch.dtype, name: str = "auto") -> AttentionBackend:
    """A fresh backend for a model on `device` in `dtype`: `name`, or with "auto" the best one there
    is for the device. A fresh one each call: a backend may hold buffers it reuses step after step."""
    device = torch.device(device)
    if name == "auto":
        name = "cpu_tiled" if device.type == "cpu" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    backend_class, device_types = ATTENTION_BACKENDS[name]
    if device_types is not None and device.type not in device_types:
        raise ValueError(f"attention backend {name!r} runs on {' or '.join(device_types)} only, not on {device.type}")
    return backend_class(device, dtype)
