"""The HTTP API's errors: an APIError becomes an OpenAI-style error body with its status. Handlers,
request parsers and the transport (timeouts, limits) raise them."""

from __future__ import annotations

from ..errors import InvalidParameter


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


def refused(e: InvalidParameter) -> APIError:
    """The 400 for a check of a layer below (a chat message's, a tool's): its words, naming the field it names."""
    return invalid(e.param, str(e), e.code)
