"""A conversation's tool definitions checked as OpenAI checks them, for the server's `tools` field and LLM.chat's
`tools=` argument alike (InvalidParameter naming the field; the server answers it with its 400).

A tool is OpenAI's `{"type": "function", "function": {"name", "description", "parameters", "strict"}}`, its
parameters a JSON schema of an object. Tools render through the chat template's `tools` variable, so a template
that has none cannot take them.
"""

from __future__ import annotations

import re

from ..errors import InvalidParameter
from .chat_content import show
from .chat_template import ChatTemplate
from .message_checks import A_TEMPLATE_THAT_DOES, check_optional

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def check_tools(tools, template: ChatTemplate | None) -> None:
    """`tools` (a non-empty list: none is no tools) checked, then that `template` renders them (None: they are not
    to be rendered, as under the server's tool_choice "none")."""
    if not isinstance(tools, list):
        raise InvalidParameter("tools", f"'tools' must be a list of tools, got {show(tools)}", "invalid_type")
    for i, tool in enumerate(tools):
        _check_tool(tool, i)
    names = [t["function"]["name"] for t in tools]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise InvalidParameter("tools", f"two tools are named {twice!r}: a call must say which one it is")
    # The tools themselves first: a malformed one is the caller's to fix, whatever this model renders.
    if template is not None and not template.supports_tools:
        raise InvalidParameter("tools", "this model's chat template does not render tools, so the model could not be "
                               f"told about them: {A_TEMPLATE_THAT_DOES}, or send no tools (to the server, "
                               "tool_choice 'none')", "unsupported_parameter")


def _check_tool(tool, i: int) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidParameter(f"tools[{i}]", f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                               f"{{...}}}}, got {show(tool)}", "invalid_type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidParameter(f"tools[{i}].function", f"'tools[{i}].function' must be an object with a 'name'",
                               "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        code = "missing_required_parameter" if name is None else "invalid_value"
        raise InvalidParameter(f"tools[{i}].function.name", f"'tools[{i}].function.name' must be 1 to 64 letters, "
                               f"digits, '_' or '-', got {show(name)}", code)
    check_optional(function, "description", f"tools[{i}].function.description", str)
    check_optional(function, "strict", f"tools[{i}].function.strict", bool)
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise InvalidParameter(f"tools[{i}].function.parameters", f"'tools[{i}].function.parameters' must be a JSON "
                               f"schema of an object, got {show(parameters)}", "invalid_type")
    if parameters is not None:  # what every choice reads, "auto" too (it only renders them): its shape, at least
        _check_object_schema(parameters, f"tools[{i}].function.parameters")


def _check_object_schema(schema: dict, param: str) -> None:
    """An object schema's `properties` (an object of schemas) and `required` (a list of names): OpenAI refuses
    a tool whose parameters are not a valid schema, where a template would render it into the prompt as it is."""
    properties, required = schema.get("properties"), schema.get("required")
    if properties is not None and not (isinstance(properties, dict)
                                       and all(isinstance(p, (dict, bool)) for p in properties.values())):
        raise InvalidParameter(f"{param}.properties", f"'{param}.properties' must be an object of schemas, got "
                               f"{show(properties)}", "invalid_type")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise InvalidParameter(f"{param}.required", f"'{param}.required' must be a list of property names, got "
                               f"{show(required)}", "invalid_type")
