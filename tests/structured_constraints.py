"""The constraints the structured-output tests run, each with the check that an output meets it.

Every schema bounds its strings, arrays and numbers and closes its objects (additionalProperties false),
and every regex is finite, so that even a random model reaches the end: an output that stops must
validate, and most outputs do stop. jsonschema (a test dependency) is the reference for the schemas,
`re.fullmatch` for the regexes.
"""

from __future__ import annotations

import json
import re

import jsonschema


def obj(properties: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


def digit(low: int = 0, high: int = 9) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def text(max_length: int, **more) -> dict:
    return {"type": "string", "maxLength": max_length, **more}


SCHEMAS = [
    obj({"name": text(8)}),
    obj({"user": obj({"id": digit(0, 999), "admin": {"type": "boolean"}})}),  # nested
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"enum": ["cat", "dog", 3, None]},
    obj({"x": {"type": "number", "minimum": -5, "maximum": 5, "multipleOf": 0.5},
         "y": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),  # bounded numbers
    obj({"code": text(6, pattern="^[A-Z]{2}-[0-9]{3}$")}),  # a string pattern
    {"type": "array", "items": obj({"k": text(4), "v": digit()}), "minItems": 1, "maxItems": 2},
    obj({"a": {"type": "boolean"}, "b": {"type": "null"}}, required=["a"]),  # an optional property
    {"anyOf": [digit(0, 100), text(5)]},
    obj({"kind": {"const": "event"}, "id": {"type": "string", "format": "uuid"}}),
    {"type": "array", "items": {"type": "array", "items": digit(), "maxItems": 3}, "maxItems": 2},
    {"$defs": {"point": obj({"x": digit(), "y": digit()})}, **obj({"a": {"$ref": "#/$defs/point"},
                                                                    "b": {"$ref": "#/$defs/point"}})},
    obj({"first": text(6, minLength=2), "tags": {"type": "array", "items": text(5), "maxItems": 2}}),
]
REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no), because [a-z]{1,8}\.",
    r"[A-Z][a-z]{1,6} [0-9]{1,2}",
    r"#[0-9a-f]{6}",
    r"(\+|-)?[0-9]{1,3}\.[0-9]{2}",
    r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)",
    r"\((a|b|c)\)( (a|b|c)){0,3}",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
]
CHOICES = [["alpha", "beta", "gamma"], ["The end.", "To be continued", "42"]]
# (vLLM's structured_outputs as a dict, the check of an output): every kind, each checked by its reference
CONSTRAINTS = ([({"json": s}, "json") for s in SCHEMAS] + [({"regex": r}, "regex") for r in REGEXES]
               + [({"choice": c}, "choice") for c in CHOICES])


def meets(constraint: dict, output: str) -> bool:
    """Whether `output` is what `constraint` ({"json" | "regex" | "choice" | "json_object": ...}) asks."""
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], output) is not None
    if "choice" in constraint:
        return output in constraint["choice"]
    try:
        value = json.loads(output)
    except ValueError:
        return False
    if constraint.get("json_object"):
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, constraint["json"], format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return False
    return True
