"""One request path: an HTTP body becomes a ParsedRequest here, for /v1/completions, and with the
helpers below in chat_requests.py (/v1/chat/completions) and generate_requests.py (/generate).

Which fields each endpoint reads, refuses or only logs is the table's to say (request_fields.py);
`Endpoint.check` applies its one rule. What a value may be is SamplingParams' rule
(engine/sampling_params.py); what needs the model (a prompt's ids against the vocabulary and the
context) is the engine's check, run once at the edge (endpoints.py). Each raises InvalidParameter
naming the field, which `invalid_request` turns into the 400 naming the request's own field.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ..engine.generation_defaults import with_defaults
from ..engine.sampling_params import SamplingParams
from .api_errors import APIError, invalid
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer
from .chat_messages import show
from .json_text import SURROGATE_ESCAPE, lone_surrogate
from .request_fields import FIELDS, OPENAI_COMPLETIONS, SAMPLING, STRUCTURED, VLLM
from .stream_usage import read_usage_options
from .structured_fields import read_constraint
from .tools import Tools

log = logging.getLogger("minfer.serve")

SCORING = {"logprobs", "echo", "prompt_logprobs"}  # the completions fields scoring/ serves

KINDS = {  # kind -> (description for the error message, check)
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "bool": ("a boolean", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "any": ("any value", lambda v: True),
}


# Clients may invent any number of names: past these, an endpoint neither logs nor keeps more.
MAX_LOGGED_FIELDS = 100


class Endpoint:
    """What one endpoint reads, which API's fields it knows (None: minfer's own), and the contract's rule."""

    def __init__(self, path: str, reads: set[str], api: frozenset[str] | None, asks_nothing: dict | None = None):
        self.path, self.reads, self.api = path, frozenset(reads), api
        self.asks_nothing = asks_nothing or {}  # a field's own values here: its API's default differs by endpoint
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: dict) -> None:
        for name, value in body.items():
            if name not in self.reads:
                self._judge_unread(name, value)

    def _judge_unread(self, name: str, value) -> None:
        """The rule for a field this endpoint does not read: minfer's own API refuses it; an API's field
        minfer does not implement is refused unless its value asks for nothing; any other is logged once."""
        if self.api is None:
            hint = " (it takes 'max_new_tokens')" if name == "max_tokens" else ""
            raise invalid(name, f"'{name}' is not a field of {self.path}{hint}", "unknown_parameter")
        nothing = self.asks_nothing.get(name, FIELDS[name].asks_nothing) if name in self.api else None
        if nothing is None:
            self.log_once(name)
        elif value is not None and not any(value == v and type(value) is type(v) for v in nothing):
            raise invalid(name, f"'{name}' is not supported by this server", "unsupported_parameter")

    def log_once(self, name: str) -> None:
        with self._lock:
            if name in self._logged or len(self._logged) >= MAX_LOGGED_FIELDS:
                return
            self._logged.add(name)
            last = len(self._logged) == MAX_LOGGED_FIELDS
        log.warning("%s: ignoring the field %r, which minfer does not use (logged once%s)", self.path, name,
                    f"; {MAX_LOGGED_FIELDS} such names now: no more are logged" if last else "")


COMPLETIONS = Endpoint("/v1/completions", SAMPLING | STRUCTURED | {"model", "prompt", "max_tokens", "stream",
                       "stream_options", "echo", "logprobs", "prompt_logprobs"}, OPENAI_COMPLETIONS | VLLM,
                       asks_nothing={"add_special_tokens": (True,)})  # vLLM's default: what a prompt gets


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
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage so far in every chunk
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
    if SURROGATE_ESCAPE.search(raw) and (where := lone_surrogate(body)):  # a pair is a character, one alone is not
        raise APIError(400, f"'{where}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not in a pair): it is "
                       "not text", param=where, code="invalid_json")
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


# ---- /v1/completions ---------------------------------------------------------------------


def parse_completion(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /v1/completions: one prompt or a batch (strings or token ids), with logprobs, echo and
    prompt_logprobs for scoring."""
    body = opened_body(body, info, COMPLETIONS)
    prompts, texts = _prompt_batch(body.get("prompt"), info.tokenizer)
    scoring, asks = _scoring(body) if SCORING & body.keys() or body.get("max_tokens") == 0 else (None, {})
    score_only = scoring is not None and scoring.score_only
    max_tokens = 1 if score_only else output_budget(body, "max_tokens", max(map(len, prompts)), info, default=16)
    constraint, source = read_constraint(body) if STRUCTURED & body.keys() else (None, None)
    fields = {"structured_outputs": source} if source else {}
    params = sampling_params(body, max_tokens, get(body, "ignore_eos", False, "bool"), fields,
                             structured_outputs=constraint, **asks)
    return ParsedRequest(prompts, params, *stream_flags(body, COMPLETIONS), fields, texts, scoring)


def _scoring(body: dict) -> tuple[Scoring, dict]:
    """What a completions request asks of scoring, and the SamplingParams fields that ask it of the engine."""
    logprobs, echo, asked = body.get("logprobs"), get(body, "echo", False), body.get("prompt_logprobs")
    numbers = all(KINDS["int"][1](v) for v in (logprobs, asked or 0))  # else SamplingParams says which is bad
    prompt_logprobs = max(asked or 0, logprobs) if echo and logprobs is not None and numbers else asked
    score_only = body.get("max_tokens") == 0 and type(body.get("max_tokens")) is int
    if score_only and not echo:
        raise invalid("max_tokens", "'max_tokens' may be 0 only with 'echo': true (to score the prompt)")
    fields = dict(logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    return Scoring(logprobs, echo, asked is not None, score_only), fields


def _prompt_batch(prompt, tokenizer: Tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """`prompt` as a batch: its token ids and its text (None where it came as ids), one per prompt."""
    if isinstance(prompt, str):  # one prompt, as text
        return [tokenizer.encode_prompt(prompt)], [prompt]
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(prompt, list) and prompt and _is_ids(prompt):
        return [list(prompt)], [None]  # one prompt, as token ids
    return _prompt_list(prompt, tokenizer)


def _prompt_list(prompt, tokenizer: Tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """A non-empty list of strings, or of token-id lists."""
    if not isinstance(prompt, list):
        raise invalid("prompt", f"'prompt' must be a string or a list, got {type(prompt).__name__}", "invalid_type")
    if not prompt:
        raise invalid("prompt", "'prompt' is an empty list: give at least one prompt")
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode_prompt(p) for p in prompt], list(prompt)
    if not all(isinstance(p, list) for p in prompt):
        raise invalid(
            "prompt", "'prompt' must be a string, a list of token ids, a list of strings or a list of token-id lists; "
            "a list may not mix them", "invalid_type",
        )
    for i, p in enumerate(prompt):
        if not _is_ids(p):
            raise invalid(f"prompt[{i}]", f"'prompt[{i}]' must be a list of token ids", "invalid_type")
    return [list(p) for p in prompt], [None] * len(prompt)


def _is_ids(prompt: list) -> bool:
    return all(KINDS["int"][1](t) for t in prompt)


# ---- what the endpoints share ------------------------------------------------------------


def opened_body(body: dict, info: ModelInfo, endpoint: Endpoint, sampling: bool = True) -> dict:
    """The body with the checkpoint's sampling defaults under the fields it left out (an endpoint that
    samples); the model it names checked, and its fields checked against the contract."""
    if sampling and info.sampling_defaults:
        body = with_defaults(body, info.sampling_defaults)
    model = get(body, "model")
    if model is not None and model != info.name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {info.name!r}", param="model",
                       code="model_not_found")
    endpoint.check(body)
    return body


def stream_flags(body: dict, endpoint: Endpoint) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage)."""
    stream, options = get(body, "stream", False), get(body, "stream_options")
    return (stream, *((False, False) if options is None else read_usage_options(options, stream, endpoint.log_once)))


def output_budget(body: dict, name: str, num_prompt_tokens: int, info: ModelInfo, default: int | None):
    """max_tokens as sent; if absent, `default` clipped to the room the prompt leaves (None: all of it).
    The engine judges it (SamplingParams, then its check against the context)."""
    value = body.get(name)
    if value is not None:
        return value
    room = max(1, info.max_model_len - num_prompt_tokens)  # a prompt that fills the context is the engine's to refuse
    return room if default is None else min(default, room)


# Each stop string is searched for after every token, on the engine's one thread: thousands slow every request.
MAX_STOP_STRINGS = 64  # OpenAI allows 4; vLLM does not limit them


def sampling_params(body: dict, max_tokens, ignore_eos, fields: dict[str, str], **extra: Any) -> SamplingParams:
    """The request's SamplingParams, JSON's conventions applied (null is the default, top_k -1 is vLLM's
    "off", best_of may only equal n); SamplingParams judges the values."""
    kwargs = {f.sets: body[name] for name, f in FIELDS.items() if f.sets and body.get(name) is not None}
    if isinstance(kwargs.get("stop"), list) and len(kwargs["stop"]) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' lists {len(kwargs['stop'])} strings; at most {MAX_STOP_STRINGS} are allowed")
    if kwargs.get("top_k") == -1 and type(kwargs["top_k"]) is int:
        kwargs["top_k"] = 0
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    n, best_of = 1 if body.get("n") is None else body["n"], body.get("best_of")
    if best_of is not None and (best_of != n or type(best_of) is not type(n)):  # true is not 1
        raise invalid("best_of", f"'best_of' = {best_of!r} is not supported: this server returns every sample it "
                      f"draws, so best_of may only equal n ({n}); ask for n = {best_of!r} and pick yourself",
                      "unsupported_parameter")
    try:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, n=n, **kwargs, **extra)
    except ValueError as e:
        raise invalid_request(e, fields) from None


def _logit_bias(bias) -> dict[int, float]:
    """JSON's object keys are strings: {"50256": -100} biases token 50256."""
    if not isinstance(bias, dict):
        raise invalid("logit_bias", f"'logit_bias' must be an object {{token id: bias}}, got {show(bias)}",
                      "invalid_type")
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise invalid("logit_bias", f"'logit_bias' keys must be token ids, got {show(list(bias))}") from None
