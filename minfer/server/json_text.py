"""A JSON body's strings that are not text: JSON may escape a lone UTF-16 surrogate (\\ud800-\\udfff not in a
pair), which Python's json module reads into a str that no encoder or tokenizer takes."""

from __future__ import annotations

import re

from ..text.tokenizer import is_text

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # what JSON writes a UTF-16 surrogate as


def lone_surrogate(value, path: str = "") -> str | None:
    """Where in a JSON value a string is not valid Unicode ("body" where it is a key at the top), else None."""
    if isinstance(value, str):
        return None if is_text(value) else path or "body"
    if isinstance(value, dict):
        for key, item in value.items():
            if where := lone_surrogate(key, path) or lone_surrogate(item, f"{path}.{key}" if path else key):
                return where
    if isinstance(value, list):
        for i, item in enumerate(value):
            if where := lone_surrogate(item, f"{path}[{i}]"):
                return where
    return None
