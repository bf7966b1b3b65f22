"""The error every layer may raise for a bad request field: InvalidParameter, raised where the rule
lives and passed on unchanged. SamplingParams checks its own fields and the scheduler checks prompts;
callers do not check again, and the HTTP API turns it into a 400 whose `param` names the field
(server/api_errors.py)."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request field with a bad value. `param` names the field ("temperature", "prompt", ...);
    `code` says what kind of problem it is, in OpenAI's error vocabulary."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


class BadSetting(ValueError):
    """A setting this model cannot run with (--max-model-len past its context, more --num-kv-blocks than fit): a bad
    flag, found once the model's config is read. The commands exit 2 for it, as argparse does for any bad flag."""


def is_int(value) -> bool:
    """An int that is not a bool (JSON's true is no token id, count or seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def whole_number(text: str) -> int | None:
    """The number `text` writes in ASCII digits, else None (a sign, a space, "1e3"; "²", a digit to isdigit)."""
    return int(text) if text.isascii() and text.isdigit() else None
