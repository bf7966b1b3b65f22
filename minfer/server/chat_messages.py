"""Chat messages -> the prompt text, through the checkpoint's chat template (text/chat_template.py).

A message is {"role", "content"}: content a string, or a list of text parts ({"type": "text", "text": ...});
an assistant's may be null, as OpenAI allows. An assistant message may hold the `tool_calls` it made
(OpenAI's shape: id, type, function name and arguments as a JSON string), and a `tool` message answers
one, naming it by `tool_call_id`, in the order OpenAI requires (ToolTurns: every call answered, once, before
the next message that is not a tool message). Both reach a tool-aware template as OpenAI sends them, but for the
arguments, which it gets as an object (as transformers and vLLM hand them over). GPT-2 has no template,
so its messages render as one `role: content` line each, then `assistant:` for the model to continue
(reply_flags: vLLM's add_generation_prompt and continue_final_message say how the prompt ends):

    system: You are terse.
    user: Hi!
    assistant:
"""

from __future__ import annotations

import json

from .api_errors import invalid
from ..errors import InvalidParameter
from ..text.chat_content import CHAT_ROLES, content_text, show
from ..text.chat_template import ChatTemplate, ChatTemplateError, opens_a_reply

KIND_NAMES = {str: "a string", bool: "a boolean"}


def check_optional(obj: dict, key: str, param: str, kind: type) -> None:
    """A 400 naming `param` if obj[key] is given (not null) and not of `kind`: OpenAI's optional labels and flags
    (a name, a description, strict) ask for no work here, but a wrong one is the client's mistake to hear of."""
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise invalid(param, f"'{param}' must be {KIND_NAMES[kind]}, got {show(value)}", "invalid_type")


def message_text(content, role: str, i: int) -> str:
    """A message's content as text (text/chat_content.py); a 400 naming the part at fault otherwise."""
    try:
        return content_text(content, role, f"messages[{i}].content")
    except InvalidParameter as e:
        raise invalid(e.param, str(e), e.code) from None


class ToolTurns:
    """The order OpenAI requires of a conversation's calls: an assistant message with `tool_calls` is followed by
    tool messages, one answering each call (by `tool_call_id`) before any other message comes, and a tool
    message answers a call of the assistant message its run of tool messages follows."""

    def __init__(self):
        self.caller: int | None = None  # the index of the assistant message whose calls the tool messages answer
        self.calls: list[str] = []  # its calls' ids
        self.unanswered: list[str] = []
        self.answered_by: dict[str, int] = {}  # a call's id -> the tool message that answered it

    def check_answer(self, answered: str, i: int) -> None:
        param = f"messages[{i}].tool_call_id"
        if answered not in self.calls:
            of = f"of messages[{self.caller}] (its calls: {', '.join(self.calls)})" if self.caller is not None \
                else "right before it"
            raise invalid(param, f"'{param}' is {show(answered)}, the id of no tool call {of}: a tool message "
                          "answers a call of the assistant message it follows")
        if answered in self.answered_by:  # two results for one call: which one the model should read is unsaid
            raise invalid(param, f"'{param}' is {show(answered)}, a call messages[{self.answered_by[answered]}] "
                          "already answers: each call has one tool message")
        self.unanswered.remove(answered)
        self.answered_by[answered] = i

    def check_turn(self, role: str, i: int) -> None:
        """A message that is not a tool message: the previous calls must all have been answered."""
        if self.unanswered:
            raise invalid(f"messages[{i}].role", f"'messages[{self.caller}]' is an assistant message with "
                          "'tool_calls': tool messages must follow it, answering each 'tool_call_id', before "
                          f"messages[{i}] (a {role} message). No tool message answers {', '.join(self.unanswered)}")
        self.caller, self.calls = None, []

    def called(self, ids: list[str], i: int) -> None:
        self.caller, self.calls, self.unanswered, self.answered_by = i, ids, list(ids), {}

    def check_end(self, add_generation_prompt: bool) -> None:
        """A reply asked for after calls nobody answered: OpenAI's 400. Without a reply asked for (/tokenize's
        add_generation_prompt false), the conversation may end at its calls."""
        if self.unanswered and add_generation_prompt:
            param = f"messages[{self.caller}].tool_calls"
            raise invalid(param, f"'{param}': the conversation ends before tool messages answer each "
                          f"'tool_call_id'. No tool message answers {', '.join(self.unanswered)}")


def tool_fields(m: dict, i: int, template: ChatTemplate, turns: ToolTurns) -> dict:
    """An assistant message's tool_calls, or a tool message's tool_call_id (and name), checked where the
    template renders tools, in the order OpenAI requires (`turns`). A template that does not render tools
    refuses tool_calls (they would vanish from the prompt), and a tool message itself or shows it as text (its
    tool_call_id refused: no message could have made the call it names).
    Each call's arguments reach the template as an object, as transformers' and vLLM's do: a template that
    writes `arguments | tojson` (Llama 3.1's) would write a JSON string's text as a string."""
    if not template.supports_tools:
        if m.get("tool_calls") is not None:  # dropped from the prompt, the model would never see them
            raise invalid(f"messages[{i}].tool_calls", "this model's chat template does not render tool calls, so "
                          f"'messages[{i}].tool_calls' could not reach the model: serve it with a template that "
                          "does (--chat-template)", "unsupported_parameter")
        if m["role"] == "tool" and m.get("tool_call_id") is not None:  # it could answer none of them
            raise invalid(f"messages[{i}].tool_call_id", f"'messages[{i}].tool_call_id' answers no call: this "
                          "model's chat template does not render tool calls, so no message here made one")
        return {}
    if m["role"] == "tool":
        answered = m.get("tool_call_id")
        if not isinstance(answered, str):
            raise invalid(f"messages[{i}].tool_call_id", f"'messages[{i}].tool_call_id' is required: a tool message "
                          "answers the call it names", "missing_required_parameter")
        turns.check_answer(answered, i)
        return {k: m[k] for k in ("tool_call_id", "name") if m.get(k) is not None}
    turns.check_turn(m["role"], i)
    calls = m.get("tool_calls")
    if m["role"] != "assistant" or calls is None:
        return {}
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls", f"'messages[{i}].tool_calls' must be a list", "invalid_type")
    if not calls:  # OpenAI's 400 too: leave tool_calls out (or null) for a message that calls nothing
        raise invalid(f"messages[{i}].tool_calls", f"'messages[{i}].tool_calls' is an empty list: give at least "
                      "one call, or leave it out", "empty_array")
    read = []
    for k, call in enumerate(calls):
        param = f"messages[{i}].tool_calls[{k}]"
        if not isinstance(call, dict):
            shape = '{"id", "type": "function", "function": {"name", "arguments": a JSON string}}'
            raise invalid(param, f"'{param}' must be {shape}, got {show(call)}", "invalid_type")
        _require(call, "id", str, f"{param}.id", "the id its tool message names")
        if call.get("type", "function") != "function":
            raise invalid(f"{param}.type", f"'{param}.type' must be 'function', got {show(call['type'])}")
        function = _require(call, "function", dict, f"{param}.function", "an object with the name and arguments")
        _require(function, "name", str, f"{param}.function.name", "the name of the function called")
        read.append({**call, "function": {**function, "arguments": _arguments(function, f"{param}.function")}})
    ids = [call["id"] for call in read]
    twice = next((k for k, id_ in enumerate(ids) if id_ in ids[:k]), None)
    if twice is not None:  # a tool message answering that id would answer both
        raise invalid(f"messages[{i}].tool_calls[{twice}].id", f"'messages[{i}].tool_calls[{twice}].id' is "
                      f"{show(ids[twice])}, the id of an earlier call of the same message: each call needs its own")
    turns.called(ids, i)
    return {"tool_calls": read}


def _require(obj: dict, key: str, kind: type, param: str, what: str):
    value = obj.get(key)
    if not isinstance(value, kind):
        raise invalid(param, f"'{param}' must be {what}, got {show(value)}",
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
        raise invalid(f"{param}.arguments", f"'{param}.arguments' must be a JSON object as text, such as "
                      f"'{{\"city\": \"Paris\"}}', got {show(text)}")
    return arguments


def reply_flags(body: dict) -> tuple[bool, bool]:
    """vLLM's (add_generation_prompt, continue_final_message): by default the reply opens an assistant message
    of its own; with continue_final_message it goes on with the last message's text instead, and
    add_generation_prompt then defaults to false (both true is the render's 400)."""
    for name in ("add_generation_prompt", "continue_final_message"):
        check_optional(body, name, name, bool)
    continues = body.get("continue_final_message") is True
    return opens_a_reply(body.get("add_generation_prompt"), continues), continues


def render_messages(body: dict, template: ChatTemplate, tools: list[dict] | None = None) -> str:
    """body["messages"] checked and rendered with the chat template (chat completions and /tokenize), with
    `tools` (checked: tools.py) for a template that renders them, ending as reply_flags says."""
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid("messages", f"'messages' must be a list, got {show(messages)}", "invalid_type")
    if not messages:
        raise invalid("messages", "'messages' is empty: give at least one message")
    rendered, turns = [], ToolTurns()
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"'messages[{i}]' must be an object, got {show(m)}", "invalid_type")
        if m.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}")
        text = message_text(m.get("content"), m["role"], i)
        check_optional(m, "name", f"messages[{i}].name", str)
        named = {"name": m["name"]} if m.get("name") is not None else {}  # who spoke, for a template that shows it
        rendered.append({"role": m["role"], "content": text, **named, **tool_fields(m, i, template, turns)})
    add_generation_prompt, continue_final_message = reply_flags(body)
    if template.supports_tools:
        turns.check_end(add_generation_prompt)
    variables = body.get("chat_template_kwargs")  # vLLM's extension, e.g. {"enable_thinking": false} for Qwen3
    if variables is not None and not isinstance(variables, dict):
        raise invalid("chat_template_kwargs", f"'chat_template_kwargs' must be an object, got {show(variables)}",
                      "invalid_type")
    try:
        return template.render(rendered, add_generation_prompt, variables, tools, continue_final_message)
    except ChatTemplateError as e:
        raise invalid("messages", str(e)) from None
    except InvalidParameter as e:  # a chat_template_kwargs name it cannot take, or a message it cannot continue
        raise invalid(e.param, str(e), e.code) from None
