"""POST /generate, minfer's own plain API, parsed with the helpers completions use too (requests.py)."""

from __future__ import annotations

from .api_errors import invalid
from .chat_messages import show
from .request_fields import SAMPLING
from ..engine.generation_defaults import with_defaults
from .requests import Endpoint, ModelInfo, ParsedRequest, get, output_budget, sampling_params

GENERATE = Endpoint("/generate", (SAMPLING - {"ignore_eos", "best_of"}) | {"prompt", "max_new_tokens", "stop_on_eos",
                                                                           "stream"}, None)


def parse_generate(body: dict, info: ModelInfo) -> ParsedRequest:
    """POST /generate: {prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_on_eos, stream}."""
    GENERATE.check(body)  # minfer's own API: a field it does not read is a mistake
    body = with_defaults(body, info.sampling_defaults)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    if not isinstance(prompt, str):
        raise invalid("prompt", f"'prompt' must be a string, got {show(prompt)}", "invalid_type")
    ids = info.tokenizer.encode_prompt(prompt)
    fields = {"max_tokens": "max_new_tokens"}
    max_tokens = output_budget(body, "max_new_tokens", len(ids), info, default=64)
    if body.get("n") not in (None, 1):
        raise invalid("n", f"'n' must be 1 on this endpoint, got {show(body['n'])}")
    params = sampling_params(body, max_tokens, not get(body, "stop_on_eos", True), fields)
    return ParsedRequest([ids], params, get(body, "stream", False), fields=fields)
