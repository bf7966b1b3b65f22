"""The request fields that ask for structured output, read into one StructuredOutputsParams.

Three ways to ask, on /v1/completions and /v1/chat/completions alike; a request uses one of them:
- OpenAI's `response_format`: {"type": "text"} (asks nothing), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (the openai SDK's `parse` sends
  this; `name` is required, as OpenAI and vLLM require it; minfer enforces the schema whatever `strict` says;
  without `schema`, optional in OpenAI's API, the reply is any JSON value: the empty schema, where vLLM would
  leave it unconstrained);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}, with
  "whitespace_pattern" or "disable_any_whitespace" for JSON;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with
  `guided_whitespace_pattern`.
A shape that is wrong is a 400 naming the field here; a schema, regex or grammar that does not compile
is the engine's to find (structured/grammars.py), when it checks the request at the edge, and its 400
names the request's field too (ParsedRequest.fields maps "structured_outputs" to it).
"""

from __future__ import annotations

import re

from ..engine.structured_outputs_params import StructuredOutputsParams
from ..errors import InvalidParameter
from ..text.chat_template import ChatTemplate
from .api_errors import invalid
from .chat_messages import check_optional, show

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
READ = frozenset({"response_format", "structured_outputs", "guided_whitespace_pattern", *GUIDED})  # what endpoints read
SUPPORTED = ("json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "disable_any_whitespace")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def read_constraint(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """(what the output must match, the request field that asked), or (None, None) if nothing is asked."""
    asked: list[tuple[str, dict]] = []
    if body.get("response_format") is not None:
        kwargs = _response_format(body["response_format"])
        if kwargs is not None:
            asked.append(("response_format", kwargs))
    if body.get("structured_outputs") is not None:
        asked.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    asked += [(name, {key: body[name]}) for name, key in GUIDED.items() if body.get(name) is not None]
    if len(asked) > 1:
        first, second = asked[0][0], asked[1][0]
        raise invalid(second, f"'{first}' and '{second}' both ask for structured output: give only one of them")
    whitespace = body.get("guided_whitespace_pattern")
    if not asked:
        if whitespace is not None:
            raise invalid("guided_whitespace_pattern", "'guided_whitespace_pattern' applies only to a JSON schema")
        return None, None
    name, kwargs = asked[0]
    if whitespace is not None:
        if "json" not in kwargs and not kwargs.get("json_object"):
            raise invalid("guided_whitespace_pattern", "'guided_whitespace_pattern' applies only to a JSON schema")
        kwargs["whitespace_pattern"] = whitespace
    try:
        return StructuredOutputsParams(**kwargs), name
    except InvalidParameter as e:
        raise invalid(name, f"'{name}' is invalid: {e}") from None


def without_thinking(body: dict, template: ChatTemplate) -> dict:
    """The chat body to render under a constraint: enable_thinking false where the template reads it
    (ChatTemplate.without_thinking), unless the request's chat_template_kwargs says otherwise."""
    variables = template.without_thinking(body.get("chat_template_kwargs"))
    return body if variables is body.get("chat_template_kwargs") else {**body, "chat_template_kwargs": variables}


def _response_format(value) -> dict | None:
    """StructuredOutputsParams' keyword arguments for OpenAI's response_format; None for plain text."""
    if not isinstance(value, dict):
        raise invalid("response_format", f"'response_format' must be an object, got {show(value)}", "invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format.json_schema", "'response_format.json_schema' must be an object "
                          f"holding the schema under 'schema', got {show(spec)}", "invalid_type")
        _check_schema_name(spec.get("name"))
        for key, kind in (("description", str), ("strict", bool)):
            check_optional(spec, key, f"response_format.json_schema.{key}", kind)
        schema = spec.get("schema")
        if schema is None:  # optional in OpenAI's API: no schema constrains nothing, but the reply is JSON
            return {"json": {}}
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema",
                          f"'response_format.json_schema.schema' must be a JSON schema object, got {show(schema)}",
                          "invalid_type")
        return {"json": schema}
    wanted = ", ".join(repr(k) for k in RESPONSE_FORMATS)
    code = "unsupported_parameter" if isinstance(kind, str) else "invalid_value"
    raise invalid("response_format.type", f"'response_format.type' must be one of {wanted}, got {show(kind)}", code)


def _check_schema_name(name) -> None:
    """OpenAI requires the schema's name, in the alphabet and length of a function's name (vLLM requires it too)."""
    param = "response_format.json_schema.name"
    if name is None:
        raise invalid(param, f"Missing required parameter: '{param}': name the schema (1 to 64 letters, digits, "
                      "'_' or '-')", "missing_required_parameter")
    if not isinstance(name, str):
        raise invalid(param, f"'{param}' must be a string, got {show(name)}", "invalid_type")
    if not SCHEMA_NAME.fullmatch(name):
        raise invalid(param, f"'{param}' must be 1 to 64 letters, digits, '_' or '-', got {show(name)}",
                      "invalid_value")


def _structured_outputs(value) -> dict:
    """StructuredOutputsParams' keyword arguments for vLLM's structured_outputs: its keys minfer reads; any
    other that asks for something is a 400 naming it."""
    if not isinstance(value, dict):
        message = f"'structured_outputs' must be an object, got {show(value)}"
        raise invalid("structured_outputs", message, "invalid_type")
    for key, v in value.items():
        if key not in SUPPORTED and v not in (None, False):
            raise invalid(f"structured_outputs.{key}", f"'structured_outputs.{key}' is not supported by this "
                          f"server; it reads {', '.join(SUPPORTED)}", "unsupported_parameter")
    return {key: v for key, v in value.items() if key in SUPPORTED and v is not None}
