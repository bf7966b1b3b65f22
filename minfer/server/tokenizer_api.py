"""The tokenizer endpoints, in vLLM's shapes: what evaluation harnesses use to count and cut prompts
with the server's own tokenizer (lm-evaluation-harness's `tokenizer_backend=remote`, which
`tokenizer_backend=auto` picks when /tokenizer_info and /tokenize answer).

    POST /tokenize    {prompt | messages, add_special_tokens, return_token_strs}
                      -> {count, max_model_len, tokens, token_strs}
    POST /detokenize  {tokens} -> {prompt}
    GET  /tokenizer_info  -> {tokenizer_class, eos_token, bos_token, pad_token, chat_template,
                              model_max_length}

`add_special_tokens` defaults as in vLLM: true for a prompt (what a completion's prompt gets), false
for messages (the chat template writes its own). `add_generation_prompt` (messages only) defaults true.
"""

from __future__ import annotations

from ..errors import is_int
from .api_errors import invalid
from .chat_messages import render_messages
from .requests import ModelInfo


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"'{name}' must be a boolean, got {value!r}", "invalid_type")
    return value


def tokenize(body: dict, info: ModelInfo) -> dict:
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise invalid("prompt", "give exactly one of 'prompt' or 'messages'", "missing_required_parameter")
    tokenizer = info.tokenizer
    if prompt is not None:
        if not isinstance(prompt, str):
            raise invalid("prompt", f"'prompt' must be a string, got {type(prompt).__name__}", "invalid_type")
        special = _flag(body, "add_special_tokens", True)
        text = prompt
    else:
        special = _flag(body, "add_special_tokens", False)
        text = render_messages(body, info.chat_template, _flag(body, "add_generation_prompt", True))
    tokens = tokenizer.encode_prompt(text) if special else tokenizer.encode(text)
    strs = None
    if _flag(body, "return_token_strs", False):
        strs = [tokenizer.id_to_token(t) for t in tokens]
    return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(body: dict, info: ModelInfo) -> dict:
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
