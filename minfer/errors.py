"""The error types every layer may raise: a bad request field, and an HTTP API error; and which device
errors no retry survives.

The one error type for a bad request is raised where the rule lives and passed on unchanged.

SamplingParams checks its own fields and the scheduler checks prompts; each raises
InvalidParameter naming the field at fault. Callers do not check again: the HTTP
API turns it into a 400 whose `param` is that name. APIError is that HTTP answer: the
server layer raises it (the transport layer too, for timeouts and limits).
"""

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


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the client caused (4xx) or should retry (429, 503): becomes an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    """The 400 for a bad request field, naming it (every request parser raises these)."""
    return APIError(400, message, param=param, code=code)


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
