"""The tokenizer endpoints, in vLLM's shapes: what evaluation harnesses use to count and cut prompts
with the server's own tokenizer (lm-evaluation-harness's `tokenizer_backend=remote`, which
`tokenizer_backend=auto` picks when /tokenizer_info and /tokenize answer).

    POST /tokenize    {prompt | messages (with tools, chat_template_kwargs), add_special_tokens,
                       add_generation_prompt, continue_final_message, return_token_strs}
                      -> {count, max_model_len, tokens, token_strs}
    POST /detokenize  {model, tokens} -> {prompt}
    GET  /tokenizer_info  -> {tokenizer_class, eos_token, bos_token, pad_token, chat_template,
                              model_max_length}

`add_special_tokens` defaults as in vLLM: true for a prompt (what a completion's prompt gets), false
for messages (the chat template writes its own). `add_generation_prompt` and `continue_final_message`
(messages only) end the rendering as a chat completion's (chat_messages.reply_flags).
`tools` are rendered as a chat completion renders them, so the count is the prompt's the model would see.
Fields are judged by the server's one rule (request_fields.py): a field of vLLM's tokenize API that
minfer does not apply is refused unless it asks for nothing; any other is logged once.
"""

from __future__ import annotations

from ..errors import is_int
from .api_errors import invalid
from .chat_messages import render_messages
from .requests import Endpoint, ModelInfo, opened_body
from .tools import read_tools

MESSAGES_ONLY = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
NOTHING_ASKED = {"continue_final_message": False}  # a prompt may carry it at its default (vLLM's clients send it)
# vLLM's tokenize requests (TokenizeCompletionRequest, TokenizeChatRequest): the fields of that API
TOKENIZE_API = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs", *MESSAGES_ONLY,
                          "chat_template", "mm_processor_kwargs"})
TOKENIZE = Endpoint("/tokenize", TOKENIZE_API - {"chat_template", "mm_processor_kwargs"}, TOKENIZE_API)
DETOKENIZE = Endpoint("/detokenize", {"model", "tokens"}, frozenset({"model", "tokens"}))  # vLLM's DetokenizeRequest


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {value!r}", "invalid_type")
    return value


def tokenize(body: dict, info: ModelInfo) -> dict:
    opened_body(body, info, TOKENIZE, sampling=False)  # the model it names, and its fields
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise invalid("prompt", "give exactly one of 'prompt' or 'messages'", "missing_required_parameter")
    tokenizer = info.tokenizer
    if prompt is not None:
        if not isinstance(prompt, str):
            raise invalid("prompt", f"'prompt' must be a string, got {type(prompt).__name__}", "invalid_type")
        chat_only = next((name for name in MESSAGES_ONLY if body.get(name) is not None
                          and not (name in NOTHING_ASKED and body[name] is NOTHING_ASKED[name])), None)
        if chat_only is not None:
            raise invalid(chat_only, f"'{chat_only}' applies to 'messages' (a chat), not to a 'prompt'")
        special = _flag(body, "add_special_tokens", True)
        text = prompt
    else:
        special = _flag(body, "add_special_tokens", False)
        tools = read_tools({"tools": body.get("tools")}, info.chat_template)  # only rendered: no tool_choice here
        text = render_messages(body, info.chat_template, tools and tools.rendered)
    tokens = tokenizer.encode_prompt(text) if special else tokenizer.encode(text)
    strs = None
    if _flag(body, "return_token_strs", False):
        strs = [tokenizer.id_to_token(t) for t in tokens]
    return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(body: dict, info: ModelInfo) -> dict:
    opened_body(body, info, DETOKENIZE, sampling=False)  # the model it names, and its fields
    tokens = body.get("tokens")
    if tokens is None:
        raise invalid("tokens", "'tokens' is required", "missing_required_parameter")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise invalid("tokens", "'tokens' must be a list of token ids", "invalid_type")
    vocab = info.tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid("tokens", f"token id {bad} is not in the vocabulary [0, {vocab})")
    return {"prompt": info.tokenizer.decode(tokens)}


def tokenizer_info(info: ModelInfo) -> dict:
    tokenizer, template = info.tokenizer, info.chat_template
    eos = tokenizer.eos_token_id
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.id_to_token(eos) if eos is not None else None,
        "bos_token": template.special_tokens.get("bos_token"),
        "pad_token": template.special_tokens.get("pad_token"),
        "chat_template": template.source,
        "model_max_length": info.max_model_len,
    }
