"""A conversation's messages checked as OpenAI checks them, and made what the chat template reads: one set of
rules for the server's /v1/chat/completions (and /tokenize) and LLM.chat alike, so a bad message gets the same
words in both. Each check raises InvalidParameter naming what is wrong (`messages[2].tool_calls`); the server
answers it with its 400.

A message is {"role", "content"}: content a string, or a list of text parts (chat_content.py); an assistant's
may be null, as OpenAI allows. A `name` (who spoke) reaches the template. An assistant message may hold the
`tool_calls` it made (OpenAI's shape: id, type, function name and arguments as a JSON string), and a `tool`
message answers one, naming it by `tool_call_id`, in the order OpenAI requires (ToolTurns: every call answered,
once, before the next message that is not a tool message). Both reach a tool-aware template as OpenAI sends
them, but for the arguments, which it gets as an object (as transformers and vLLM hand them over).
"""

from __future__ import annotations

import json

from ..errors import InvalidParameter
from .chat_content import CHAT_ROLES, content_text, show
from .chat_template import ChatTemplate

KIND_NAMES = {str: "a string", bool: "a boolean"}
# What a caller whose template renders no tools can do: the server's flag, or LLM.chat's argument.
A_TEMPLATE_THAT_DOES = "give a chat template that does (the server's --chat-template, LLM.chat's chat_template=)"


def check_optional(obj: dict, key: str, param: str, kind: type) -> None:
    """InvalidParameter naming `param` if obj[key] is given (not null) and not of `kind`: OpenAI's optional labels
    and flags (a name, a description, strict) ask for no work here, but a wrong one is the caller's to hear of."""
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise InvalidParameter(param, f"'{param}' must be {KIND_NAMES[kind]}, got {show(value)}", "invalid_type")


def checked_messages(messages, template: ChatTemplate, add_generation_prompt: bool, name: str = "messages"):
    """`messages` checked, each as the template gets it: role, content as text, name, and the tool fields a
    tool-aware template renders. `name` is what errors call the list (LLM.chat's second conversation:
    messages[1]); `add_generation_prompt` says whether a reply follows, which calls nobody answered forbid."""
    if messages is None:
        raise InvalidParameter(name, f"'{name}' is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise InvalidParameter(name, f"'{name}' must be a list, got {show(messages)}", "invalid_type")
    if not messages:
        raise InvalidParameter(name, f"'{name}' is empty: give at least one message")
    checked, turns = [], ToolTurns(name)
    for i, m in enumerate(messages):
        at = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise InvalidParameter(at, f"'{at}' must be an object, got {show(m)}", "invalid_type")
        if m.get("role") not in CHAT_ROLES:
            raise InvalidParameter(f"{at}.role", f"'{at}.role' must be one of {', '.join(CHAT_ROLES)}")
        text = content_text(m.get("content"), m["role"], f"{at}.content")
        check_optional(m, "name", f"{at}.name", str)
        named = {"name": m["name"]} if m.get("name") is not None else {}  # who spoke, for a template that shows it
        checked.append({"role": m["role"], "content": text, **named, **tool_fields(m, i, template, turns)})
    if template.supports_tools:
        turns.check_end(add_generation_prompt)
    return checked


class ToolTurns:
    """The order OpenAI requires of a conversation's calls: an assistant message with `tool_calls` is followed by
    tool messages, one answering each call (by `tool_call_id`) before any other message comes, and a tool
    message answers a call of the assistant message its run of tool messages follows."""

    def __init__(self, name: str = "messages"):
        self.name = name  # what errors call the conversation
        self.caller: int | None = None  # the index of the assistant message whose calls the tool messages answer
        self.calls: list[str] = []  # its calls' ids
        self.unanswered: list[str] = []
        self.answered_by: dict[str, int] = {}  # a call's id -> the tool message that answered it

    def check_answer(self, answered: str, i: int) -> None:
        param = f"{self.name}[{i}].tool_call_id"
        if answered not in self.calls:
            of = f"of {self.name}[{self.caller}] (its calls: {', '.join(self.calls)})" if self.caller is not None \
                else "right before it"
            raise InvalidParameter(param, f"'{param}' is {show(answered)}, the id of no tool call {of}: a tool "
                                   "message answers a call of the assistant message it follows")
        if answered in self.answered_by:  # two results for one call: which one the model should read is unsaid
            raise InvalidParameter(param, f"'{param}' is {show(answered)}, a call "
                                   f"{self.name}[{self.answered_by[answered]}] already answers: each call has one "
                                   "tool message")
        self.unanswered.remove(answered)
        self.answered_by[answered] = i

    def check_turn(self, role: str, i: int) -> None:
        """A message that is not a tool message: the previous calls must all have been answered."""
        if self.unanswered:
            raise InvalidParameter(f"{self.name}[{i}].role", f"'{self.name}[{self.caller}]' is an assistant message "
                                   "with 'tool_calls': tool messages must follow it, answering each 'tool_call_id', "
                                   f"before {self.name}[{i}] (a {role} message). No tool message answers "
                                   f"{', '.join(self.unanswered)}")
        self.caller, self.calls = None, []

    def called(self, ids: list[str], i: int) -> None:
        self.caller, self.calls, self.unanswered, self.answered_by = i, ids, list(ids), {}

    def check_end(self, add_generation_prompt: bool) -> None:
        """A reply asked for after calls nobody answered: OpenAI's 400. Without a reply asked for (/tokenize's
        add_generation_prompt false), the conversation may end at its calls."""
        if self.unanswered and add_generation_prompt:
            param = f"{self.name}[{self.caller}].tool_calls"
            raise InvalidParameter(param, f"'{param}': the conversation ends before tool messages answer each "
                                   f"'tool_call_id'. No tool message answers {', '.join(self.unanswered)}")


def tool_fields(m: dict, i: int, template: ChatTemplate, turns: ToolTurns) -> dict:
    """An assistant message's tool_calls, or a tool message's tool_call_id (and name), of the conversation's
    message `i`, checked where the template renders tools, in the order OpenAI requires (`turns`). A template
    that does not render tools refuses tool_calls (they would vanish from the prompt), and a tool message itself
    or shows it as text (its tool_call_id refused: no message could have made the call it names).
    Each call's arguments reach the template as an object, as transformers' and vLLM's do: a template that
    writes `arguments | tojson` (Llama 3.1's) would write a JSON string's text as a string."""
    at = f"{turns.name}[{i}]"
    if not template.supports_tools:
        if m.get("tool_calls") is not None:  # dropped from the prompt, the model would never see them
            raise InvalidParameter(f"{at}.tool_calls", "this model's chat template does not render tool calls, so "
                                   f"'{at}.tool_calls' could not reach the model: {A_TEMPLATE_THAT_DOES}",
                                   "unsupported_parameter")
        if m["role"] == "tool" and m.get("tool_call_id") is not None:  # it could answer none of them
            raise InvalidParameter(f"{at}.tool_call_id", f"'{at}.tool_call_id' answers no call: this model's chat "
                                   "template does not render tool calls, so no message here made one")
        return {}
    if m["role"] == "tool":
        answered = m.get("tool_call_id")
        if not isinstance(answered, str):
            raise InvalidParameter(f"{at}.tool_call_id", f"'{at}.tool_call_id' is required: a tool message "
                                   "answers the call it names", "missing_required_parameter")
        turns.check_answer(answered, i)
        return {k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None}
    turns.check_turn(m["role"], i)
    calls = m.get("tool_calls")
    if m["role"] != "assistant" or calls is None:
        return {}
    if not isinstance(calls, list):
        raise InvalidParameter(f"{at}.tool_calls", f"'{at}.tool_calls' must be a list", "invalid_type")
    if not calls:  # OpenAI's 400 too: leave tool_calls out (or null) for a message that calls nothing
        raise InvalidParameter(f"{at}.tool_calls", f"'{at}.tool_calls' is an empty list: give at least one call, "
                               "or leave it out", "empty_array")
    read = [_call(call, f"{at}.tool_calls[{k}]") for k, call in enumerate(calls)]
    ids = [call["id"] for call in read]
    twice = next((k for k, id_ in enumerate(ids) if id_ in ids[:k]), None)
    if twice is not None:  # a tool message answering that id would answer both
        param = f"{at}.tool_calls[{twice}].id"
        raise InvalidParameter(param, f"'{param}' is {show(ids[twice])}, the id of an earlier call of the same "
                               "message: each call needs its own")
    turns.called(ids, i)
    return {"tool_calls": read}


def _call(call, param: str) -> dict:
    """One of an assistant message's tool_calls, checked, its arguments read into an object."""
    if not isinstance(call, dict):
        shape = '{"id", "type": "function", "function": {"name", "arguments": a JSON string}}'
        raise InvalidParameter(param, f"'{param}' must be {shape}, got {show(call)}", "invalid_type")
    _require(call, "id", str, f"{param}.id", "the id its tool message names")
    if call.get("type", "function") != "function":
        raise InvalidParameter(f"{param}.type", f"'{param}.type' must be 'function', got {show(call['type'])}")
    function = _require(call, "function", dict, f"{param}.function", "an object with the name and arguments")
    _require(function, "name", str, f"{param}.function.name", "the name of the function called")
    return {**call, "function": {**function, "arguments": _arguments(function, f"{param}.function")}}


def _require(obj: dict, key: str, kind: type, param: str, what: str):
    value = obj.get(key)
    if not isinstance(value, kind):
        raise InvalidParameter(param, f"'{param}' must be {what}, got {show(value)}",
                               "missing_required_parameter" if value is None else "invalid_type")
    return value


def _arguments(function: dict, param: str) -> dict:
    """A call's arguments, read from their JSON text: an object ("" for none, as vLLM reads it)."""
    text = _require(function, "arguments", str, f"{param}.arguments", "a JSON object as text")
    try:
        arguments = json.loads(text) if text else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidParameter(f"{param}.arguments", f"'{param}.arguments' must be a JSON object as text, such as "
                               f"'{{\"city\": \"Paris\"}}', got {show(text)}")
    return arguments
