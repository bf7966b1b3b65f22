"""The error every layer may raise for a bad request field: InvalidParameter, raised where the rule
lives and passed on unchanged. SamplingParams checks its own fields and the scheduler checks prompts;
callers do not check again, and the HTTP API turns it into a 400 whose `param` names the field
(server/api_errors.py). And which device errors no retry survives (is_sticky_device_error)."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request field with a bad value. `param` names the field ("temperature", "prompt", ...);
    `code` says what kind of problem it is, in OpenAI's error vocabulary."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def is_int(value) -> bool:
    """An int that is not a bool (JSON's true is no token id, count or seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def whole_number(text: str) -> int | None:
    """The number `text` writes in ASCII digits, else None (a sign, a space, "1e3"; "²", a digit to isdigit)."""
    return int(text) if text.isascii() and text.isdigit() else None


# CUDA errors after which the process's CUDA context is broken: every later call fails the same way, so
# the only recovery is a new process (the server stops, non-zero, for its supervisor to restart it).
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
