"""to_device: a host list as a tensor on the device, without making the host wait for the GPU.

Every step builds small tensors from Python lists (token ids, slots, block tables, sampling settings).
`torch.tensor(values, device="cuda")` copies synchronously: the CPU waits until the GPU has run all it
was given, once per call, where the engine allows one wait a step (tests/rooms/gpu/test_cuda.py). An asynchronous
copy from ordinary (pageable) memory is no better: the driver waits on the stream first. So on a GPU the
list goes through pinned memory, which torch's caching host allocator keeps until the copy is done.
On a CPU it is just the tensor.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; on a GPU, copied without a host sync."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
