"""Chat messages -> the prompt text, through the checkpoint's chat template (text/chat_template.py).

The messages are checked as LLM.chat checks them (text/message_checks.py: role, content, name, tool_calls,
tool_call_id and OpenAI's order of calls and answers); a message that breaks a rule is a 400 naming it. GPT-2
has no template, so its messages render as one `role: content` line each, then `assistant:` for the model to
continue (reply_flags: vLLM's add_generation_prompt and continue_final_message say how the prompt ends):

    system: You are terse.
    user: Hi!
    assistant:
"""

from __future__ import annotations

from .api_errors import invalid, refused
from ..errors import InvalidParameter
from ..text import message_checks
from ..text.chat_content import show
from ..text.chat_template import ChatTemplate, ChatTemplateError, opens_a_reply
from ..text.message_checks import checked_messages


def check_optional(obj: dict, key: str, param: str, kind: type) -> None:
    """A 400 naming `param` if obj[key] is given (not null) and not of `kind` (message_checks.check_optional)."""
    try:
        message_checks.check_optional(obj, key, param, kind)
    except InvalidParameter as e:
        raise refused(e) from None


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
    add_generation_prompt, continue_final_message = reply_flags(body)
    variables = body.get("chat_template_kwargs")  # vLLM's extension, e.g. {"enable_thinking": false} for Qwen3
    if variables is not None and not isinstance(variables, dict):
        raise invalid("chat_template_kwargs", f"'chat_template_kwargs' must be an object, got {show(variables)}",
                      "invalid_type")
    try:
        messages = checked_messages(body.get("messages"), template, add_generation_prompt)
        return template.render(messages, add_generation_prompt, variables, tools, continue_final_message)
    except ChatTemplateError as e:
        raise invalid("messages", str(e)) from None
    except InvalidParameter as e:  # a message's fault, a chat_template_kwargs name it cannot take, or a message
        raise refused(e) from None  # it cannot continue
