"""Which device errors no retry survives: after one, the process's CUDA context is broken, and every
later call fails the same way. The server stops, non-zero, for its supervisor to start a new process."""

from __future__ import annotations

STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "misaligned address",
    "an illegal instruction was encountered",
    "unspecified launch failure",
    "hardware stack error",
    "uncorrectable ECC error",
)


def is_sticky_device_error(error: BaseException) -> bool:
    """Whether `error` is a sticky CUDA error (STICKY_CUDA_ERRORS), raised as torch raises them: a
    RuntimeError (torch.AcceleratorError, in newer torch) whose message names it."""
    message = str(error)
    return isinstance(error, RuntimeError) and any(sticky in message for sticky in STICKY_CUDA_ERRORS)
