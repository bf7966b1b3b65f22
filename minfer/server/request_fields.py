"""Every body field an endpoint knows, declared once, as data: its JSON kind, the API it belongs to
(OpenAI's, vLLM's extension, or minfer's own /generate), the SamplingParams field it sets, and the
room that applies it. The serving contract is one rule over this table (requests.Endpoint.check):
- a field the endpoint reads is applied;
- a field of OpenAI's or vLLM's API that minfer does not implement gets a 400 naming it, unless it holds
  the value that asks for nothing (`n: 1`, `tools: []`, null);
- a field of neither API is logged once per name and ignored, as vLLM does (OpenAI's account fields,
  `user`, `metadata`, `store`..., ask nothing of a local server and are treated the same way);
- /generate is minfer's own API: a field it does not read is refused.
"""

from __future__ import annotations

from typing import NamedTuple

from .structured_fields import READ as STRUCTURED
from .tools import READ as TOOLS


class Field(NamedTuple):
    api: str  # "openai", "vllm" (its extension) or "minfer" (/generate's own)
    kind: str = "any"  # the JSON kind this parser checks; the value is SamplingParams' to judge
    sets: str | None = None  # the SamplingParams field it sets, if it maps straight onto one
    feature: str = ""  # the room that applies it (scoring/, parallel_sampling/), if one does
    asks_nothing: tuple = ()  # for a field minfer does not implement: the values that ask for nothing


F = Field
# name -> Field, for every field of either API that one of the endpoints knows.
FIELDS: dict[str, Field] = {
    # the request and its prompt
    "model": F("openai", "str"), "prompt": F("openai"), "messages": F("openai"), "stream": F("openai", "bool"),
    "stream_options": F("openai", "object"), "max_tokens": F("openai"), "max_completion_tokens": F("openai"),
    "chat_template_kwargs": F("vllm", "object"),
    # sampling (engine/sampling_params.py judges the values)
    "temperature": F("openai", sets="temperature"), "top_p": F("openai", sets="top_p"),
    "seed": F("openai", sets="seed"),
    "stop": F("openai", sets="stop"), "presence_penalty": F("openai", sets="presence_penalty"),
    "frequency_penalty": F("openai", sets="frequency_penalty"), "logit_bias": F("openai"),
    "top_k": F("vllm", sets="top_k"), "min_p": F("vllm", sets="min_p"), "min_tokens": F("vllm", sets="min_tokens"),
    "repetition_penalty": F("vllm", sets="repetition_penalty"), "stop_token_ids": F("vllm", sets="stop_token_ids"),
    "include_stop_str_in_output": F("vllm", sets="include_stop_str_in_output"), "ignore_eos": F("vllm"),
    "skip_special_tokens": F("vllm", sets="skip_special_tokens"),
    "n": F("openai", feature="parallel_sampling"), "best_of": F("openai", asks_nothing=(1,)),
    # scoring
    "logprobs": F("openai", feature="scoring"), "top_logprobs": F("openai", feature="scoring"),
    "echo": F("openai", "bool", feature="scoring"), "prompt_logprobs": F("vllm", feature="scoring"),
    # structured outputs (structured_fields.py reads them)
    "response_format": F("openai", feature="structured"), "structured_outputs": F("vllm", feature="structured"),
    **{name: F("vllm", feature="structured") for name in STRUCTURED - {"response_format", "structured_outputs"}},
    **{name: F("openai", feature="tools") for name in TOOLS},  # tools.py reads them (functions: to refuse them)
    # /generate's own
    "max_new_tokens": F("minfer"), "stop_on_eos": F("minfer", "bool"),
    # OpenAI's, not implemented
    **{name: F("openai", asks_nothing=nothing) for name, nothing in {
        "suffix": ("",), "audio": (),
        "modalities": (["text"],), "moderation": (), "prediction": (), "reasoning_effort": (), "verbosity": (),
        "web_search_options": (),
    }.items()},
    # vLLM's, not implemented
    **{name: F("vllm", asks_nothing=nothing) for name, nothing in {
        "use_beam_search": (False,), "length_penalty": (1, 1.0), "allowed_token_ids": ([],), "bad_words": ([],),
        "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (), "logits_processors": (),
        "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
        "guided_decoding_backend": ("auto", "guidance"), "priority": (0,), "request_id": (), "cache_salt": (),
        "kv_transfer_params": (), "prompt_embeds": (), "structural_tag": (), "include_reasoning": (True,),
        "vllm_xargs": (), "add_special_tokens": (), "add_generation_prompt": (True,),
        "continue_final_message": (False,), "documents": (), "chat_template": (), "mm_processor_kwargs": (),
    }.items()},
    # OpenAI's account and storage fields: nothing a local server could apply (logged once)
    **{name: F("openai", asks_nothing=None) for name in (
        "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention", "prompt_cache_options")},
}
SAMPLING = {"temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "top_k",
            "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
            "skip_special_tokens", "n", "best_of", "ignore_eos"}


# OpenAI's fields, per endpoint, as the openai SDK's CompletionCreateParams name them
# (tests/server/test_request_fields.py keeps these in step with the installed SDK). vLLM's extension fields apply
# to both.
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
VLLM = frozenset(name for name, f in FIELDS.items() if f.api == "vllm") | {"echo", "best_of", "response_format"}
