"""The serving contract's one rule for request fields: what an endpoint reads is applied; a field of
OpenAI's or vLLM's API that minfer does not implement is a 400 naming it (unless it asks for
nothing); a field of neither API is logged once and ignored; /generate refuses what it does not read."""

import logging

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from minfer.server.api_errors import APIError
from minfer.server import chat_requests, request_fields, requests
from minfer.server.chat_requests import parse_chat
from minfer.server.generate_requests import parse_generate
from minfer.server.requests import ModelInfo, parse_completion
from minfer.text.tokenizer import Tokenizer

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def info(tiny_checkpoint):
    return ModelInfo("m", Tokenizer.from_dir(tiny_checkpoint), 512)


def sdk_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_the_tables_know_every_field_of_the_installed_openai_sdk():
    """A new OpenAI field lands in a table by a decision, not by falling through to 'log and ignore'."""
    assert sdk_fields(completion_create_params) <= request_fields.OPENAI_COMPLETIONS
    assert sdk_fields(chat_create_params) <= request_fields.OPENAI_CHAT
    # Every field an endpoint reads is a field of the API it serves.
    assert requests.COMPLETIONS.reads <= requests.COMPLETIONS.api
    assert chat_requests.CHAT.reads <= chat_requests.CHAT.api


@pytest.mark.parametrize(
    "parse, field, value",
    [
        (parse_completion, "suffix", "and so on"),
        (parse_completion, "best_of", 3),
        (parse_completion, "use_beam_search", True),
        (parse_completion, "bad_words", ["once"]),
        (parse_completion, "length_penalty", 0.5),
        (parse_completion, "allowed_token_ids", [1, 2]),
        (parse_chat, "tools", [{"type": "function", "function": {"name": "f"}}]),
        (parse_chat, "prediction", {"type": "content", "content": "hi"}),
        (parse_chat, "reasoning_effort", "high"),
        (parse_chat, "audio", {"voice": "alloy"}),
        (parse_chat, "modalities", ["audio"]),
        (parse_chat, "documents", [{"title": "a", "text": "b"}]),
        # vLLM's, once logged and ignored: embeddings for the prompt, a structure, the reasoning left out
        (parse_completion, "prompt_embeds", "AAAA"),
        (parse_chat, "structural_tag", '{"type": "structural_tag", "structures": []}'),
        (parse_chat, "include_reasoning", False),
        # vLLM's add_special_tokens, against the endpoint's own default
        (parse_completion, "add_special_tokens", False),
        (parse_chat, "add_special_tokens", True),
    ],
)
def test_an_api_field_minfer_does_not_implement_is_a_400_naming_it(info, parse, field, value):
    body = {"prompt": "a"} if parse is parse_completion else {"messages": CHAT}
    with pytest.raises(APIError) as e:
        parse({**body, field: value}, info)
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported_parameter")
    assert field in e.value.message


@pytest.mark.parametrize(
    "parse, extra",
    [
        (parse_completion, {"suffix": "", "best_of": 1, "use_beam_search": False, "guided_json": None,
                            "add_special_tokens": True}),  # vLLM's default for a prompt: what minfer does
        (parse_chat, {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "functions": None,
                      "include_reasoning": True, "add_special_tokens": False}),  # a template writes its own
    ],
)
def test_the_values_that_ask_for_nothing_pass(info, parse, extra):
    body = {"prompt": "a"} if parse is parse_completion else {"messages": CHAT}
    parse({**body, **extra}, info)


def test_fields_of_neither_api_and_account_fields_are_logged_once(info, caplog, monkeypatch):
    for rules in (requests.COMPLETIONS, chat_requests.CHAT):  # as in a fresh server process
        monkeypatch.setattr(rules, "_logged", set())
    body = {"prompt": "a", "my_trace_id": "t-1", "user": "u-7", "metadata": {"k": "v"}, "store": False}
    with caplog.at_level(logging.WARNING, logger="minfer.serve"):
        for _ in range(3):
            parse_completion(body, info)
            parse_chat({"messages": CHAT, "my_trace_id": "t-1", "stream": True,
                        "stream_options": {"include_usage": True, "include_obfuscation": True}}, info)  # fmt: skip
    lines = caplog.messages
    for name in ("'my_trace_id'", "'user'", "'metadata'", "'store'"):
        assert sum(name in line and line.startswith("/v1/completions") for line in lines) == 1, lines
    assert sum("'my_trace_id'" in line and line.startswith("/v1/chat/completions") for line in lines) == 1
    assert sum("'stream_options.include_obfuscation'" in line for line in lines) == 1


@pytest.mark.parametrize("field", ["max_tokens", "model", "logprobs", "n", "anything"])
def test_generate_refuses_what_it_does_not_read(info, field):
    with pytest.raises(APIError) as e:
        parse_generate({"prompt": "a", field: 5}, info)
    assert (e.value.status, e.value.param) == (400, field)
    if field == "max_tokens":  # the mistake the issue met: 64 tokens came back, silently
        assert "max_new_tokens" in e.value.message


def test_detokenize_checks_the_model_it_names_as_tokenize_does(info):
    """/detokenize answered for any model named: a client pointed at the wrong server read another tokenizer's text."""
    from minfer.server.tokenizer_api import detokenize, tokenize

    for endpoint, body in ((tokenize, {"prompt": "a"}), (detokenize, {"tokens": [1]})):
        with pytest.raises(APIError) as e:
            endpoint({**body, "model": "other"}, info)
        assert (e.value.status, e.value.param) == (404, "model")
    assert detokenize({"model": "m", "tokens": info.tokenizer.encode("ab")}, info) == {"prompt": "ab"}


def test_invented_field_names_are_logged_and_kept_only_so_many(info, caplog, monkeypatch):
    """Every new name was kept and logged forever: 20 bodies of 20,000 random names grew a server by 52 MB of
    memory and 54 MB of log."""
    monkeypatch.setattr(requests.COMPLETIONS, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="minfer.serve"):
        for i in range(10):
            parse_completion({"prompt": "a", **{f"x{i}_{j}": 0 for j in range(2000)}}, info)
    assert 10 <= len(caplog.messages) <= requests.MAX_LOGGED_FIELDS
    assert len(requests.COMPLETIONS._logged) <= requests.MAX_LOGGED_FIELDS
    assert "no more are logged" in caplog.messages[-1]
