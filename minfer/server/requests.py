"""One request path: an HTTP body becomes a ParsedRequest here, for /v1/completions, /v1/chat/completions
and /generate.

Which fields each endpoint reads, refuses or only logs is the table's to say (request_fields.py);
`Endpoint.check` applies its one rule. What a value may be is SamplingParams' rule
(engine/sampling_params.py); what needs the model (a prompt's ids against the vocabulary and the
context) is the engine's check, run once at the edge (endpoints.py). Each raises InvalidParameter
naming the field, which `invalid_request` turns into the 400 naming the request's own field. Chat
messages render through the checkpoint's template (chat_messages.py).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ..engine.sampling_params import SamplingParams
from .api_errors import APIError, invalid
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer
from .chat_messages import render_messages, show
from .request_fields import FIELDS, OPENAI_CHAT, OPENAI_COMPLETIONS, SAMPLING, STRUCTURED, TOOLS, VLLM

from .structured_fields import read_constraint, without_thinking
from .tools import Tools, read_tools

log = logging.getLogger("minfer.serve")

SCORING = {"logprobs", "echo", "prompt_logprobs"}  # the completions fields scoring/ serves

KINDS = {  # kind -> (description for the error message, check)
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "bool": ("a boolean", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "any": ("any value", lambda v: True),
}


class Endpoint:
    """What one endpoint reads, which API's fields it knows (None: minfer's own), and the contract's rule."""

    def __init__(self, path: str, reads: set[str], api: frozenset[str] | None):
        self.path, self.reads, self.api = path, frozenset(reads), api
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: dict) -> None:
        for name, value in body.items():
            if name in self.reads:
                continue
            if self.api is None:
                hint = " (it takes 'max_new_tokens')" if name == "max_tokens" else ""
                raise invalid(name, f"'{name}' is not a field of {self.path}{hint}", "unknown_parameter")
            nothing = FIELDS[name].asks_nothing if name in self.api else None
            if nothing is not None:  # a field of the API that minfer does not implement
                if value is None or any(value == v and type(value) is type(v) for v in nothing):
                    continue
                raise invalid(name, f"'{name}' is not supported by this server", "unsupported_parameter")
            self.log_once(name)

    def log_once(self, name: str) -> None:
        with self._lock:
            if name in self._logged:
                return
            self._logged.add(name)
        log.warning("%s: ignoring the field %r, which minfer does not use (logged once)", self.path, name)


COMPLETIONS = Endpoint("/v1/completions", SAMPLING | STRUCTURED | {"model", "prompt", "max_tokens", "stream",
                       "stream_options", "echo", "logprobs", "prompt_logprobs"}, OPENAI_COMPLETIONS | VLLM)
CHAT = Endpoint("/v1/chat/completions", SAMPLING | STRUCTURED | TOOLS | {"model", "messages", "max_tokens",
                "max_completion_tokens", "stream", "stream_options", "chat_template_kwargs", "logprobs",
                "top_logprobs"}, OPENAI_CHAT | VLLM)
GENERATE = Endpoint("/generate", (SAMPLING - {"ignore_eos", "best_of"}) | {"prompt", "max_new_tokens", "stop_on_eos",
                                                                           "stream"}, None)


@dataclass
class ModelInfo:
    """What request parsing needs to know about the served model."""

    name: str  # the name clients must use in "model"
    tokenizer: Tokenizer
    max_model_len: int  # prompt + output tokens one request may use
    chat_template: ChatTemplate = field(default_factory=lambda: ChatTemplate(None))  # None: plain rendering
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's, for fields a request omits


@dataclass
class Scoring:
    """What a completions request asks of scoring (scoring/ computes it; logprobs_format.py writes it)."""

    logprobs: int | None  # k likeliest per token; None: no logprobs in the response
    echo: bool  # the prompt's text (and, with logprobs, its logprobs) ahead of the completion
    return_prompt_logprobs: bool  # vLLM's `prompt_logprobs` field in each choice
    score_only: bool  # max_tokens 0 with echo: nothing is generated


@dataclass
class ParsedRequest:
    """A request as the engine will run it: one engine request per prompt, each with `params`."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    # The request's own name for an engine field where the two differ ({"max_tokens": "max_new_tokens"}),
    # so that an error the engine raises later names the field the client sent.
    fields: dict[str, str] = field(default_factory=dict)
    prompt_texts: list[str | None] = field(default_factory=list)  # each prompt's text, where it came as text
    scoring: Scoring | None = None  # completions' logprobs, echo, prompt_logprobs
    tools: Tools | None = None  # chat's tools: what the responder reads calls back with

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompts[0]


def invalid_request(e: ValueError, fields: dict[str, str] | None = None) -> APIError:
    """The engine's verdict on a request (SamplingParams, OnlineScheduler.check_request) as a 400; `fields`
    maps the engine's name for the field at fault to this endpoint's (chat's prompt is its "messages")."""
    param, code = getattr(e, "param", None), getattr(e, "code", "invalid_value")
    message, name = str(e), (fields or {}).get(param, param)
    if name != param:  # the engine's words name its own field: say which of the request's it is
        message = f"'{name}' is invalid: {message}"
    return APIError(400, message, param=name, code=code)


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


def get(body: dict, name: str, default=None, kind: str | None = None):
    """body[name] if present and of its kind; `default` if absent or null (JSON's "the default"); else a 400."""
    value = body.get(name)
    if value is None:
        return default
    description, check = KINDS[kind or FIELDS[name].kind]
    if not check(value):
        raise invalid(name, f"'{name}' must be {description}, got {show(value)}", "invalid_type")
    return value


# ---- the three endpoints ---------------------------------------------------------------


def parse_completion(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /v1/completions: one prompt or a batch (strings or token ids), with logprobs, echo and
    prompt_logprobs for scoring."""
    body = _opened(body, info, COMPLETIONS)
    prompts, texts = _prompt_batch(body.get("prompt"), info.tokenizer)
    scoring, asks = _scoring(body) if SCORING & body.keys() or body.get("max_tokens") == 0 else (None, {})
    score_only = scoring is not None and scoring.score_only
    max_tokens = 1 if score_only else _max_tokens(body, "max_tokens", max(map(len, prompts)), info, default=16)
    constraint, source = read_constraint(body) if STRUCTURED & body.keys() else (None, None)
    fields = {"structured_outputs": source} if source else {}
    params = _params(body, max_tokens, get(body, "ignore_eos", False, "bool"), fields, structured_outputs=constraint,
                     **asks)
    return ParsedRequest(prompts, params, *_stream(body, COMPLETIONS), fields, texts, scoring)


def _scoring(body: dict) -> tuple[Scoring, dict]:
    """What a completions request asks of scoring, and the SamplingParams fields that ask it of the engine."""
    logprobs, echo, asked = body.get("logprobs"), get(body, "echo", False), body.get("prompt_logprobs")
    numbers = all(KINDS["int"][1](v) for v in (logprobs, asked or 0))  # else SamplingParams says which is bad
    prompt_logprobs = max(asked or 0, logprobs) if echo and logprobs is not None and numbers else asked
    score_only = body.get("max_tokens") == 0 and type(body.get("max_tokens")) is int
    if score_only and not echo:
        raise invalid("max_tokens", "'max_tokens' may be 0 only with 'echo': true (to score the prompt)")
    return Scoring(logprobs, echo, asked is not None, score_only), dict(logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def parse_chat(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /v1/chat/completions: messages rendered through the checkpoint's chat template."""
    body = _opened(body, info, CHAT)
    tools = read_tools(body, info.chat_template) if TOOLS & body.keys() else None
    constraint, source = read_constraint(body) if STRUCTURED & body.keys() else (None, None)
    if tools is not None and tools.enforced:  # "required" or a named function: the grammar of its calls
        constraint, source = tools.constraint(constraint, source), "tools"
    if constraint is not None:  # a constrained reply starts with what its grammar wants: no <think> block first
        body = without_thinking(body)
    ids = info.tokenizer.encode(render_messages(body, info.chat_template, tools=tools and tools.rendered))  # BOS too
    # max_completion_tokens is the current name; max_tokens the deprecated one. No limit: up to the context.
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    wanted, top = get(body, "logprobs", kind="bool"), body.get("top_logprobs")
    if top is not None and not wanted:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    fields = {"prompt": "messages", "max_tokens": name, "logprobs": "top_logprobs", "structured_outputs": source}
    logprobs = (0 if top is None else top) if wanted else None
    params = _params(body, _max_tokens(body, name, len(ids), info, None), get(body, "ignore_eos", False, "bool"),
                     fields, logprobs=logprobs, structured_outputs=constraint)
    stops = info.chat_template.stop_token_ids
    if stops and not params.ignore_eos:  # the reply ends at the end of its turn
        params.stop_token_ids = [*(params.stop_token_ids or ()), *stops]
    return ParsedRequest([ids], params, *_stream(body, CHAT), fields, tools=tools)


def parse_generate(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /generate: {prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_on_eos, stream}."""
    GENERATE.check(body)  # minfer's own API: a field it does not read is a mistake
    body = {**info.sampling_defaults, **body}
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if not isinstance(prompt, str):
        raise invalid("prompt", f"'prompt' must be a string, got {show(prompt)}", "invalid_type")
    ids = info.tokenizer.encode_prompt(prompt)
    fields = {"max_tokens": "max_new_tokens"}
    max_tokens = _max_tokens(body, "max_new_tokens", len(ids), info, default=64)
    if body.get("n") not in (None, 1):
        raise invalid("n", f"'n' must be 1 on this endpoint, got {show(body['n'])}")
    params = _params(body, max_tokens, not get(body, "stop_on_eos", True), fields)
    return ParsedRequest([ids], params, get(body, "stream", False), fields=fields)


# ---- what the endpoints share ------------------------------------------------------------


def _opened(body: dict, info: ModelInfo, endpoint: Endpoint) -> dict:
    """The body with the checkpoint's sampling defaults under the fields it left out; the model it names
    checked, and its fields checked against the contract."""
    body = {**info.sampling_defaults, **body}
    model = get(body, "model")
    if model is not None and model != info.name:
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {info.name!r}", param="model",
            code="model_not_found",
        )
    endpoint.check(body)
    return body


def _stream(body: dict, endpoint: Endpoint) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream, options = get(body, "stream", False), get(body, "stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    for key in options:
        if key != "include_usage":  # vLLM's continuous_usage_stats, say
            endpoint.log_once(f"stream_options.{key}")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid("stream_options.include_usage", "'include_usage' must be a boolean", "invalid_type")
    return stream, bool(include_usage)


def _max_tokens(body: dict, name: str, num_prompt_tokens: int, info: ModelInfo, default: int | None):
    """The output budget as sent; if absent, `default` clipped to the room the prompt leaves (None: all of it).
    The engine judges it (SamplingParams, then its check against the context)."""
    value = body.get(name)
    if value is not None:
        return value
    room = max(1, info.max_model_len - num_prompt_tokens)  # a prompt that fills the context is the engine's to refuse
    return room if default is None else min(default, room)


def _params(body: dict, max_tokens, ignore_eos, fields: dict[str, str], **extra: Any) -> SamplingParams:
    """The request's SamplingParams: JSON's conventions applied (null is the default, logit_bias keys come
    as strings, top_k -1 is vLLM's "off", best_of may only equal n); SamplingParams judges the values."""
    kwargs = {f.sets: body[name] for name, f in FIELDS.items() if f.sets and body.get(name) is not None}
    if kwargs.get("top_k") == -1 and type(kwargs["top_k"]) is int:
        kwargs["top_k"] = 0
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise invalid("logit_bias", f"'logit_bias' must be an object {{token id: bias}}, got {show(bias)}",
                          "invalid_type")
        try:
            kwargs["logit_bias"] = {int(token): value for token, value in bias.items()}
        except ValueError:
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids, got {show(list(bias))}") from None
    n = body.get("n")
    n = 1 if n is None else n
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise invalid(
            "best_of", f"'best_of' = {best_of!r} is not supported: this server returns every sample it draws, so "
            f"best_of may only equal n ({n}); ask for n = {best_of!r} and pick yourself", "unsupported_parameter",
        )
    try:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, n=n, **kwargs, **extra)
    except ValueError as e:
        raise invalid_request(e, fields) from None


def _prompt_batch(prompt, tokenizer: Tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """`prompt` as a batch: its token ids and its text (None where it came as ids), one per prompt.
    A string, a list of token ids, or a non-empty list of strings or of token-id lists."""
    is_ids = lambda p: isinstance(p, list) and all(KINDS["int"][1](t) for t in p)  # noqa: E731
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_ids(prompt)):
        prompt = [prompt]  # one prompt
    if not isinstance(prompt, list):
        raise invalid("prompt", f"'prompt' must be a string or a list, got {type(prompt).__name__}", "invalid_type")
    if not prompt:
        raise invalid("prompt", "'prompt' is an empty list: give at least one prompt")
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise invalid(
            "prompt", "'prompt' must be a string, a list of token ids, a list of strings or a list of token-id lists; "
            "a list may not mix them", "invalid_type",
        )
    ids, texts = [], []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids.append(tokenizer.encode_prompt(p))
            texts.append(p)
        elif is_ids(p):
            ids.append(list(p))
            texts.append(None)
        else:
            raise invalid(f"prompt[{i}]", f"'prompt[{i}]' must be a list of token ids", "invalid_type")
    return ids, texts
