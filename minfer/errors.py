"""The one error type for a bad request, raised where the rule lives and passed on unchanged.

SamplingParams checks its own fields and the scheduler checks prompts; each raises
InvalidParameter naming the field at fault. Callers do not check again: the HTTP
API turns it into a 400 whose `param` is that name.
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
