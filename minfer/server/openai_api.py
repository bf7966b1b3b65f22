"""The OpenAI-compatible API: parse requests, render chat prompts, build responses.

Everything here is plain data in, plain data out — no sockets, no threads — so
each rule can be tested on its own. This module checks what is the API's own:
the JSON shape, OpenAI's fields (`model`, `stream_options`, message roles)
and the parameters minfer does not support. The engine's rules stay the
engine's: sampling_fields.py reads the sampling fields, SamplingParams checks them and
OnlineScheduler.check_request the prompt against the vocabulary and context,
each raising InvalidParameter naming the field; `invalid_request` turns that
into the 400 naming the request's own field.

Chat messages are rendered with the checkpoint's own chat template (chat_template.py).
GPT-2 has none, so its chat messages are rendered as one `role: content` line each,
followed by `assistant:` for the model to continue:

    system: You are terse.
    user: Hi!
    assistant:
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace

from ..engine.sampling import SamplingParams
from ..engine.sequence import CompletionDelta, RequestOutput
from ..errors import APIError, invalid, is_int
from ..text.chat_template import ChatTemplate, ChatTemplateError
from ..text.tokenizer import Tokenizer
from . import request_fields
from ..engine.generation_defaults import with_defaults
from .scoring_fields import CompletionScoring, chat_logprobs, completion_prompts, completion_scoring
from .sampling_fields import build_params

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ModelInfo:
    """What request parsing needs to know about the served model."""

    name: str  # the name clients must use in "model"
    tokenizer: Tokenizer
    max_model_len: int  # prompt + output tokens one request may use
    chat_template: ChatTemplate = field(default_factory=lambda: ChatTemplate(None))  # None: plain rendering
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's, for fields a request omits


@dataclass
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    # The request's own name for an engine field where the two differ ({"max_tokens": "max_new_tokens"}),
    # so that an error the engine raises later (OnlineScheduler.check_request) names the field the client sent.
    fields: dict[str, str] = field(default_factory=dict)
    # Completions may send a batch: every prompt (the first is prompt_token_ids), each its own engine
    # request with `params`, and its text where it came as one (scoring_fields.py).
    prompts: list[list[int]] = field(default_factory=list)
    prompt_texts: list[str | None] = field(default_factory=list)
    scoring: CompletionScoring | None = None  # completions' logprobs, echo, prompt_logprobs

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts, self.prompt_texts = [self.prompt_token_ids], [None]


# ---- errors --------------------------------------------------------------------------


def invalid_request(e: ValueError, fields: dict[str, str] | None = None) -> APIError:
    """The engine's verdict on a request (SamplingParams, OnlineScheduler.check_request) as a 400.

    The engine is the one place those rules live: its InvalidParameter names the field at fault, and
    `fields` maps that name to this endpoint's (chat's prompt is its "messages")."""
    param, code = getattr(e, "param", None), getattr(e, "code", "invalid_value")
    message = str(e)
    name = (fields or {}).get(param, param)
    if name != param:  # the engine's words name its own field: say which of the request's it is
        message = f"'{name}' is invalid: {message}"
    return APIError(400, message, param=name, code=code)


# ---- field checks: the JSON shape and OpenAI's own fields -----------------------------


KINDS = {  # name -> (description for the error message, check)
    "int": ("an integer", is_int),
    "bool": ("a boolean", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "object": ("an object", lambda v: isinstance(v, dict)),
}


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _value(body: dict, name: str, default=None):
    """body[name], or `default` where it is absent or null (JSON's way of saying "the default")."""
    value = body.get(name)
    return default if value is None else value


def _get(body: dict, name: str, kind: str, default=None):
    """body[name] if present and of the right kind; `default` if absent or null; else a 400."""
    value = body.get(name)
    if value is None:
        return default
    description, check = KINDS[kind]
    if not check(value):
        raise invalid(name, f"'{name}' must be {description}, got {_show(value)}", "invalid_type")
    return value


def parse_json_body(raw: bytes) -> dict:
    def reject_constant(name):  # json accepts NaN and Infinity; JSON does not
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
    except (ValueError, RecursionError) as e:  # ValueError covers UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _check_model(body: dict, info: ModelInfo) -> None:
    model = _get(body, "model", "str")
    if model is not None and model != info.name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {info.name!r}",
            param="model",
            code="model_not_found",
        )


def _stream_flags(body: dict, rules: request_fields.FieldRules) -> tuple[bool, bool]:
    stream = _get(body, "stream", "bool", False)
    options = _get(body, "stream_options", "object")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    rules.check_stream_options(options)
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage", "'include_usage' must be a boolean", "invalid_type")
    return stream, bool(include_usage)


# ---- sampling parameters: the engine checks them -------------------------------------


def _max_tokens(body: dict, name: str, num_prompt_tokens: int, info: ModelInfo, default: int | None):
    """The output budget as sent; if absent, `default` clipped to the room the prompt leaves (None: all of it).
    The engine checks it (SamplingParams, then check_request against the context)."""
    value = body.get(name)
    if value is not None:
        return value
    room = max(1, info.max_model_len - num_prompt_tokens)  # a prompt that fills the context is the engine's to refuse
    return room if default is None else min(default, room)


def _sampling(body: dict, max_tokens, fields: dict[str, str], *, ignore_eos: bool | None = None, allow_n=True):
    """The request's SamplingParams (sampling_fields.py reads the fields; SamplingParams checks them)."""
    try:
        return build_params(
            body, max_tokens, _value(body, "ignore_eos", False) if ignore_eos is None else ignore_eos, allow_n=allow_n
        )
    except ValueError as e:
        raise invalid_request(e, fields) from None


# ---- the three request kinds ---------------------------------------------------------


def _prompt_ids(prompt, info: ModelInfo, param: str = "prompt") -> list[int]:
    """A string, a list of token ids, or a batch of exactly one of those. Whether the ids fit the
    vocabulary and the context is the engine's to say (check_request)."""
    if prompt is None:
        raise invalid(param, f"'{param}' is required", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI clients may send a batch of one
    if isinstance(prompt, str):
        return info.tokenizer.encode_prompt(prompt)
    if isinstance(prompt, list) and all(is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid(param, f"only one prompt per request is supported, got {len(prompt)}")
    raise invalid(param, f"'{param}' must be a string or a list of token ids, got {_show(prompt)}", "invalid_type")


def parse_completion(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /v1/completions."""
    body = with_defaults(body, info.sampling_defaults)
    _check_model(body, info)
    request_fields.COMPLETIONS.check(body)
    prompts, texts = completion_prompts(body.get("prompt"), info.tokenizer)
    scoring = completion_scoring(body)
    if scoring.score_only:  # the engine draws one token, which the response leaves out
        body = {**body, "max_tokens": 1}
    max_tokens = _max_tokens(body, "max_tokens", max(map(len, prompts)), info, default=16)
    stream, include_usage = _stream_flags(body, request_fields.COMPLETIONS)
    params = _with_logprobs(_sampling(body, max_tokens, {}), scoring.logprobs, scoring.prompt_logprobs)
    return ParsedRequest(prompts[0], params, stream, include_usage, {}, prompts, texts, scoring)


def _with_logprobs(params: SamplingParams, logprobs: int | None, prompt_logprobs: int | None = None):
    return replace(params, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def _message_text(content, role: str, i: int) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...}). An
    assistant's may be null, as OpenAI allows (the SDK's tool-call histories send it): no text."""
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else None
                raise invalid(
                    f"{param}[{k}]",
                    f"'{param}[{k}]' is a {kind!r} part: this server reads text parts only"
                    if isinstance(kind, str)
                    else f"'{param}[{k}]' must be a content part such as {{\"type\": \"text\", \"text\": ...}}",
                    "unsupported_parameter" if isinstance(kind, str) else "invalid_type",
                )
            if not isinstance(part.get("text"), str):
                raise invalid(f"{param}[{k}].text", f"'{param}[{k}].text' must be a string", "invalid_type")
        return "".join(p["text"] for p in content)
    if content is None:
        raise invalid(param, f"'{param}' is required for a {role} message", "missing_required_parameter")
    raise invalid(param, f"'{param}' must be a string or a list of text parts, got {_show(content)}", "invalid_type")


def render_messages(body: dict, info: ModelInfo, add_generation_prompt: bool = True) -> str:
    """body["messages"] checked and rendered with the model's chat template (chat and /tokenize)."""
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "'messages' is required", "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid("messages", f"'messages' must be a list, got {_show(messages)}", "invalid_type")
    if not messages:
        raise invalid("messages", "'messages' is empty: give at least one message")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"'messages[{i}]' must be an object, got {_show(m)}", "invalid_type")
        if m.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}")
        rendered.append({"role": m["role"], "content": _message_text(m.get("content"), m["role"], i)})
    try:
        # chat_template_kwargs: vLLM's extension, e.g. {"enable_thinking": false} for Qwen3.
        variables = _get(body, "chat_template_kwargs", "object")
        return info.chat_template.render(rendered, add_generation_prompt, variables)
    except ChatTemplateError as e:
        raise invalid("messages", str(e)) from None


def parse_chat(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /v1/chat/completions."""
    body = with_defaults(body, info.sampling_defaults)
    _check_model(body, info)
    request_fields.CHAT.check(body)
    text = render_messages(body, info)
    ids = info.tokenizer.encode(text)  # as is: the template wrote any BOS itself
    # max_completion_tokens is the current name; max_tokens the deprecated one. No limit: up to the context.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, name, len(ids), info, default=None)
    stream, include_usage = _stream_flags(body, request_fields.CHAT)
    fields = {"prompt": "messages", "max_tokens": name}
    params = _with_logprobs(_sampling(body, max_tokens, fields), chat_logprobs(body))
    if info.chat_template.stop_token_ids and not params.ignore_eos:  # the reply ends at the end of its turn
        stops = [*(params.stop_token_ids or ()), *info.chat_template.stop_token_ids]
        params = replace(params, stop_token_ids=stops)
    return ParsedRequest(ids, params, stream, include_usage, fields)


def parse_generate(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /generate: {prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_on_eos, stream}."""
    request_fields.GENERATE.check(body)  # minfer's own API: a field it does not read is a mistake
    body = with_defaults(body, info.sampling_defaults)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise invalid("prompt", f"'prompt' must be a string, got {_show(prompt)}", "invalid_type")
    ids = _prompt_ids(prompt, info)
    max_tokens = _max_tokens(body, "max_new_tokens", len(ids), info, default=64)
    stop_on_eos = _get(body, "stop_on_eos", "bool", True)
    stream = _get(body, "stream", "bool", False)
    fields = {"max_tokens": "max_new_tokens"}
    params = _sampling(body, max_tokens, fields, ignore_eos=not stop_on_eos, allow_n=False)
    return ParsedRequest(ids, params, stream, fields=fields)


# ---- responses -----------------------------------------------------------------------


def usage(outs: RequestOutput | tuple[RequestOutput, ...] | list[RequestOutput]) -> dict:
    """The prompt counted once, the completion tokens of every choice summed (OpenAI's and vLLM's rule)."""
    outs = [outs] if isinstance(outs, RequestOutput) else list(outs)
    prompt, completion = len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Responder:
    """Builds the response body, or the stream chunks, of one completion or chat request (n choices)."""

    def __init__(self, model: str, chat: bool, n: int = 1):
        self.model = model
        self.chat = chat
        self.n = n
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _chunk(self, choices: list, **extra) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices, **extra)

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False, index: int = 0) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant's role, once per choice."""
        return [self._chunk([self._choice("", None, role=True, index=i)]) for i in range(self.n)] if self.chat else []

    def text_chunk(self, text: str) -> dict:
        return self._chunk([self._choice(text, None)])

    def delta_chunks(self, delta: CompletionDelta) -> list[dict]:
        """The stream chunks for one step's delta of a choice: its text, if it adds any (its token's text
        may be held back, or be a stop token's: the stream has no empty chunks), then, on its last delta,
        the choice's finish_reason."""
        chunks = [self._chunk([self._choice(delta.text, None, index=delta.index)])] if delta.text else []
        if delta.finish_reason is not None:
            chunks.append(self.final_chunk(delta.finish_reason, delta.index))
        return chunks

    def final_chunk(self, finish_reason: str | None, index: int = 0) -> dict:
        return self._chunk([self._choice(None, finish_reason, index=index)])

    def usage_chunk(self, outs) -> dict:
        return self._chunk([], usage=usage(outs))

    def response(self, outs: RequestOutput | tuple[RequestOutput, ...]) -> dict:
        outs = (outs,) if isinstance(outs, RequestOutput) else outs
        if self.chat:
            choices = [
                {
                    "index": out.index,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                }
                for out in outs
            ]
            return self._envelope("chat.completion", choices, usage=usage(outs))
        choices = [
            {"index": out.index, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason} for out in outs
        ]
        return self._envelope("text_completion", choices, usage=usage(outs))
