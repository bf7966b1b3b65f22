"""Which request fields the server applies, which it refuses and which it only logs: the serving
contract (DESIGN.md) in one place, for /v1/completions, /v1/chat/completions and /generate.

- A field the endpoint reads is applied (the parsers in openai_api.py; READ below lists them).
- A field of OpenAI's or vLLM's API that minfer does not implement gets a 400 naming it, unless
  it holds the value that asks for nothing (`n: 1`, `tools: []`, `suffix: ""`, null).
- A field of neither API is logged once per name and ignored, as vLLM does, so that clients
  which send extras (guidellm's `continuous_usage_stats`, a tracing id) keep working. OpenAI's
  account and storage fields (`user`, `metadata`, `store`, ...) ask nothing of a local server and
  are treated the same way.
- /generate is minfer's own API: a field it does not read is refused.
"""

from __future__ import annotations

import logging
import threading

from ..errors import invalid
from .sampling_fields import FIELDS as SAMPLING_FIELDS

log = logging.getLogger("minfer.serve")

# OpenAI's fields, as the openai SDK's CompletionCreateParams name them (tests/test_request_fields.py
# keeps these in step with the installed SDK).
OPENAI_COMPLETIONS = frozenset(
    "best_of echo frequency_penalty logit_bias logprobs max_tokens model n presence_penalty prompt seed stop "
    "stream stream_options suffix temperature top_p user".split()
)
OPENAI_CHAT = frozenset(
    "audio frequency_penalty function_call functions logit_bias logprobs max_completion_tokens max_tokens "
    "messages metadata modalities model moderation n parallel_tool_calls prediction presence_penalty "
    "prompt_cache_key prompt_cache_options prompt_cache_retention reasoning_effort response_format "
    "safety_identifier seed service_tier stop store stream stream_options temperature tool_choice tools "
    "top_logprobs top_p user verbosity web_search_options".split()
)
# vLLM's extensions (its protocol's extra sampling and request fields), to both endpoints.
VLLM_EXTRA = frozenset(
    "best_of top_k min_p repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos "
    "min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids "
    "prompt_logprobs bad_words use_beam_search logits_processors return_tokens_as_token_ids return_token_ids "
    "guided_json guided_regex guided_choice guided_grammar guided_decoding_backend guided_whitespace_pattern "
    "structured_outputs response_format priority request_id cache_salt kv_transfer_params vllm_xargs "
    "add_special_tokens echo add_generation_prompt continue_final_message documents chat_template "
    "chat_template_kwargs mm_processor_kwargs".split()
)
# OpenAI's fields for its accounts and storage: nothing a local server could apply.
NOTHING_TO_APPLY = frozenset(
    "user metadata store service_tier safety_identifier prompt_cache_key prompt_cache_retention "
    "prompt_cache_options".split()
)
# The values of unimplemented fields that ask for nothing, beside null.
NO_OP_VALUES: dict[str, tuple] = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),  # "auto" with no tools calls none
    "parallel_tool_calls": (True, False),  # meaningful only with tools
    "response_format": ({"type": "text"},),
    "use_beam_search": (False,),
    "allowed_token_ids": ([],),
    "length_penalty": (1, 1.0),
    "modalities": (["text"],),
    "bad_words": ([],),
    "priority": (0,),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
}


def _is_no_op(name: str, value) -> bool:
    return value is None or any(value == v and type(value) is type(v) for v in NO_OP_VALUES.get(name, ()))


class FieldRules:
    """check(body) for one endpoint: what it reads, which API fields exist, and what it logs."""

    def __init__(self, endpoint: str, reads: frozenset[str], api: frozenset[str] | None):
        self.endpoint = endpoint
        self.reads = reads
        self.api = api  # None: minfer's own API, where every unread field is refused
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: dict) -> None:
        for name, value in body.items():
            if name in self.reads:
                continue
            if self.api is None:
                hint = " (it takes 'max_new_tokens')" if name == "max_tokens" else ""
                raise invalid(name, f"'{name}' is not a field of {self.endpoint}{hint}", "unknown_parameter")
            if name in self.api and name not in NOTHING_TO_APPLY:
                if _is_no_op(name, value):
                    continue
                raise invalid(name, f"'{name}' is not supported by this server", "unsupported_parameter")
            self._log_once(name)

    def check_stream_options(self, options: dict) -> None:
        """stream_options' keys beyond include_usage (vLLM's continuous_usage_stats, say): logged once."""
        for key in options:
            if key != "include_usage":
                self._log_once(f"stream_options.{key}")

    def _log_once(self, name: str) -> None:
        with self._lock:
            if name in self._logged:
                return
            self._logged.add(name)
        log.warning("%s: ignoring the field %r, which minfer does not use (logged once)", self.endpoint, name)


# What sampling_fields.py reads into SamplingParams, on every endpoint.
SAMPLING_READS = frozenset(SAMPLING_FIELDS) | frozenset(("logit_bias", "n"))
COMPLETIONS = FieldRules(
    "/v1/completions",
    SAMPLING_READS
    | frozenset("model prompt max_tokens ignore_eos best_of stream stream_options echo logprobs prompt_logprobs".split()),
    OPENAI_COMPLETIONS | VLLM_EXTRA,
)
CHAT = FieldRules(
    "/v1/chat/completions",
    SAMPLING_READS
    | frozenset(
        "model messages max_tokens max_completion_tokens ignore_eos best_of stream stream_options "
        "chat_template_kwargs logprobs top_logprobs".split()
    ),
    OPENAI_CHAT | VLLM_EXTRA,
)
GENERATE = FieldRules("/generate", SAMPLING_READS | frozenset("prompt max_new_tokens stop_on_eos stream".split()), None)
