"""A chat message's content as the text its template renders, for the server and LLM.chat alike.

OpenAI's content is a string or a list of content parts; minfer reads text parts
({"type": "text", "text": ...}), one line each (joined by newlines, as vLLM joins them), and refuses any
other kind by name. An assistant's content may be null (a message that only calls tools): it renders as
empty text.
"""

from __future__ import annotations

import json

from ..errors import InvalidParameter

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def show(value) -> str:
    """A value as a message quotes it: its JSON, cut short."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def content_text(content, role: str, param: str) -> str:
    """The content as text; an InvalidParameter naming `param` (messages[i].content), or the part at fault."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        if not content:  # OpenAI's 400 too: an empty list is no content, not an empty text
            raise InvalidParameter(param, f"'{param}' is an empty list: give at least one content part, or a string")
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise InvalidParameter(f"{param}[{k}]", f"'{param}[{k}]' is a {kind!r} part: this server reads text "
                                       "parts only", "unsupported_parameter")
            if kind != "text":
                raise InvalidParameter(f"{param}[{k}]", f"'{param}[{k}]' must be a content part such as "
                                       "{\"type\": \"text\", \"text\": ...}", "invalid_type")
            if not isinstance(part.get("text"), str):
                raise InvalidParameter(f"{param}[{k}].text", f"'{param}[{k}].text' must be a string", "invalid_type")
        return "\n".join(part["text"] for part in content)
    if content is None:
        raise InvalidParameter(param, f"'{param}' is required for a {role} message", "missing_required_parameter")
    raise InvalidParameter(param, f"'{param}' must be a string or a list of text parts, got {show(content)}",
                           "invalid_type")
