"""POST /v1/chat/completions: chat messages become a ParsedRequest, through the helpers completions
use too (requests.py). What only chat asks is read here: the messages, rendered through the
checkpoint's chat template (chat_messages.py), its tools (tools.py), and its own names for the output
budget and the logprobs."""

from __future__ import annotations

from .api_errors import invalid
from .chat_messages import render_messages
from .request_fields import OPENAI_CHAT, SAMPLING, STRUCTURED, TOOLS, VLLM
from .requests import Endpoint, ModelInfo, ParsedRequest, get, opened_body, output_budget, sampling_params, stream_flags
from .structured_fields import read_constraint, without_thinking
from .tools import read_tools

CHAT = Endpoint("/v1/chat/completions", SAMPLING | STRUCTURED | TOOLS | {"model", "messages", "max_tokens",
                "max_completion_tokens", "stream", "stream_options", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message", "logprobs", "top_logprobs"}, OPENAI_CHAT | VLLM,
                asks_nothing={"add_special_tokens": (False,)})  # vLLM's default: the template writes its own


def parse_chat(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /v1/chat/completions: messages rendered through the checkpoint's chat template."""
    body = opened_body(body, info, CHAT)
    tools = read_tools(body, info.chat_template) if TOOLS & body.keys() else None
    constraint, source = read_constraint(body) if STRUCTURED & body.keys() else (None, None)
    if tools is not None and tools.enforced:  # "required" or a named function: the grammar of its calls
        constraint, source = tools.constraint(constraint, source), "tools"
        body = without_thinking(body, info.chat_template)  # a constrained reply starts as its grammar wants
    elif tools is not None and tools.strict and constraint is None:  # free text, calls held to the tools
        constraint, source = tools.constraint(), "tools"
    elif constraint is not None:
        body = without_thinking(body, info.chat_template)
    ids = info.tokenizer.encode(render_messages(body, info.chat_template, tools=tools and tools.rendered))  # BOS too
    # max_completion_tokens is the current name; max_tokens the deprecated one. No limit: up to the context.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if name == "max_completion_tokens" and body.get("max_tokens") not in (None, body[name]):  # one would be ignored
        raise invalid("max_tokens", f"'max_tokens' ({body['max_tokens']!r}) and 'max_completion_tokens' "
                      f"({body[name]!r}) disagree: send max_completion_tokens alone")
    wanted, top = get(body, "logprobs", kind="bool"), body.get("top_logprobs")
    if top is not None and not wanted:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    fields = {"prompt": "messages", "max_tokens": name, "logprobs": "top_logprobs", "structured_outputs": source}
    logprobs = (0 if top is None else top) if wanted else None
    params = sampling_params(body, output_budget(body, name, len(ids), info, None),
                             get(body, "ignore_eos", False, "bool"), fields, logprobs=logprobs,
                             structured_outputs=constraint)
    params = info.chat_template.ending_turns(params)  # the reply ends at the end of its turn
    if tools is not None:
        params = tools.uncut(params)
    return ParsedRequest([ids], params, *stream_flags(body, CHAT), fields, tools=tools)
