"""StructuredOutputsParams: what a request's output must match (SamplingParams.structured_outputs).

The request's side only: which kind of constraint, and its text, checked for shape. Compiling it into a
token mask is the structured/ room's work (llguidance), which a plain engine never loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidParameter


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's `structured_outputs`): exactly one of a JSON schema, any JSON
    object, a regex, a list of choices, or a grammar (Lark, or llama.cpp's GBNF). The structured/ room
    compiles it and masks the sampler with it; this class only checks its shape."""

    json: dict | str | None = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # a context-free grammar
    json_object: bool = False  # any JSON object
    whitespace_pattern: str | None = None  # JSON only: a regex for the whitespace between tokens
    disable_any_whitespace: bool = False  # JSON only: compact, no whitespace at all

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter(
                "structured_outputs", f"structured_outputs must give exactly one of {', '.join(self.KINDS)}; "
                f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise InvalidParameter("structured_outputs", f"the JSON schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidParameter("structured_outputs", f"a JSON schema must be an object, got {self.json!r:.60}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidParameter("structured_outputs", f"{name} must be a string, got {value!r:.60}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                message = f"choice must be a list of strings, got {self.choice!r:.60}"
                raise InvalidParameter("structured_outputs", message)
            if not self.choice:
                raise InvalidParameter("structured_outputs", "choice is an empty list: give at least one string")
            self.choice = list(self.choice)
        if self.grammar is not None and not self.grammar.strip():
            raise InvalidParameter("structured_outputs", "the grammar is empty")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter("structured_outputs", f"{name} must be a bool, got {getattr(self, name)!r:.60}")
        whitespace = self.whitespace_pattern is not None or self.disable_any_whitespace
        if whitespace and given[0] not in ("json", "json_object"):
            message = "whitespace_pattern and disable_any_whitespace apply to JSON only"
            raise InvalidParameter("structured_outputs", message)

    @property
    def kind(self) -> str:
        """Which of KINDS it gives."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))
