"""Request parsing, the chat template, response builders and metrics, without any server."""

import json

import pytest

from minfer.engine.sampling_params import SamplingParams
from minfer.engine.outputs import CompletionDelta, RequestOutput
from minfer.errors import InvalidParameter
from minfer.server.api_errors import APIError
from minfer.server.requests import (
    ModelInfo,
    ParsedRequest,
    invalid_request,
    parse_completion,
    parse_json_body,
)
from minfer.server.chat_requests import parse_chat
from minfer.server.generate_requests import parse_generate
from minfer.server.responder import Responder
from minfer.server.metrics import Histogram, Metrics
from minfer.server.prometheus import histogram_lines, render
from minfer.text.chat_template import ChatTemplate, render_chat
from minfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def info(tiny_checkpoint):
    tok = Tokenizer.from_dir(tiny_checkpoint)
    return ModelInfo("tiny", tok, max_model_len=64)


def error_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_completion_defaults_and_fields(info):
    req = parse_completion({"model": "tiny", "prompt": "Hello there"}, info)
    assert req.prompt_token_ids == info.tokenizer.encode("Hello there")
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0 and not req.stream

    req = parse_completion(
        {
            "prompt": [[5, 6, 7]],
            "max_tokens": 3,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 7,
            "stop": "x",
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "someone",
            "echo": False,
            "n": 1,
            "logprobs": None,
        },
        info,
    )
    assert req.prompt_token_ids == [5, 6, 7]  # a batch of one is unwrapped; unknown "user" is ignored
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (3, 0.0, 0.5, 0, 7)
    assert p.stop == ["x"] and p.ignore_eos and req.stream and req.include_usage


def test_default_max_tokens_is_clipped_to_the_context(info):
    ids = list(range(60))  # 4 tokens of room in a 64-token context
    assert parse_completion({"prompt": ids}, info).params.max_tokens == 4
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, info)
    assert chat.params.max_tokens == 64 - len(chat.prompt_token_ids)  # chat: all the room left


def test_chat_template_and_max_completion_tokens(info):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    assert render_chat([{"role": "user", "content": "Hi"}]) == "user: Hi\nassistant:"
    req = parse_chat({"messages": messages, "max_tokens": 5, "max_completion_tokens": 5}, info)
    assert req.prompt_token_ids == info.tokenizer.encode("system: Be brief.\nuser: Hi\n!\nassistant:")  # vLLM's join
    assert req.params.max_tokens == 5 and req.fields["max_tokens"] == "max_completion_tokens"  # the current name's
    # Two budgets that disagree: one of them would be silently ignored.
    e = error_of(parse_chat, {"messages": messages, "max_tokens": 9, "max_completion_tokens": 5}, info)
    assert (e.status, e.param) == (400, "max_tokens") and "disagree" in e.message


# Qwen3's template renders only the roles it knows: any other message (OpenAI's "developer") it drops unseen.
KNOWN_ROLES_ONLY = (
    "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant"
)


def test_a_developer_message_reaches_a_template_that_knows_only_system(info):
    """OpenAI's developer messages are the system's instructions (the SDK's newer examples send them); a template
    that knows no developer role got them dropped, and the request was answered as if they had not been sent."""
    templated = ModelInfo("tiny", info.tokenizer, 64, ChatTemplate(KNOWN_ROLES_ONLY))
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse_chat({"messages": messages}, templated)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant"
    assert req.prompt_token_ids == info.tokenizer.encode(expected)
    # A template that names the role renders it as it is; so does the plain rendering.
    naming_it = ChatTemplate(KNOWN_ROLES_ONLY.replace("'user'", "'user', 'developer'"))
    knows = ModelInfo("tiny", info.tokenizer, 64, naming_it)
    assert info.tokenizer.decode(parse_chat({"messages": messages}, knows).prompt_token_ids).startswith(
        "<|im_start|>developer\nBe brief.")
    assert parse_chat({"messages": messages}, info).prompt_token_ids == info.tokenizer.encode(
        "developer: Be brief.\nuser: Hi\nassistant:")


def test_a_message_name_reaches_the_template(info):
    """OpenAI's messages[i].name (who spoke), handed to the template as vLLM hands it over."""
    showing = ChatTemplate("{% for m in messages %}{{ m.name or '-' }}:{{ m.content }};{% endfor %}")
    messages = [{"role": "user", "content": "Hi", "name": "ada"}, {"role": "user", "content": "Yo"}]
    req = parse_chat({"messages": messages}, ModelInfo("tiny", info.tokenizer, 64, showing))
    assert info.tokenizer.decode(req.prompt_token_ids) == "ada:Hi;-:Yo;"


def test_assistant_content_may_be_null(info):
    """The openai SDK sends an assistant turn that only called a tool with content null (tests/rooms/structured
    render one through a template that reads tools). The plain rendering shows no calls: it refuses them, by name,
    rather than drop them from the prompt, and renders a null content as empty. A tool message's tool_call_id then
    answers no call: refused too, where it had been accepted and dropped."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "c1"},
    ]
    with pytest.raises(APIError) as refused:
        parse_chat({"messages": messages}, info)
    assert refused.value.status == 400 and refused.value.param == "messages[1].tool_calls"
    del messages[1]["tool_calls"]
    with pytest.raises(APIError) as refused:
        parse_chat({"messages": messages}, info)
    assert refused.value.param == "messages[2].tool_call_id" and "answers no call" in refused.value.message
    del messages[2]["tool_call_id"]
    req = parse_chat({"messages": messages}, info)
    assert req.prompt_token_ids == info.tokenizer.encode("user: Weather?\nassistant: \ntool: sunny\nassistant:")


def test_generate_fields(info):
    req = parse_generate({"prompt": "Hi", "max_new_tokens": 5, "stop_on_eos": False, "top_k": 3}, info)
    assert req.params.max_tokens == 5 and req.params.ignore_eos and req.params.top_k == 3
    assert parse_generate({"prompt": "Hi"}, info).params.ignore_eos is False


@pytest.mark.parametrize(
    "parse, body, status, param",
    [
        (parse_completion, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        (parse_completion, {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
        (parse_completion, {"prompt": ["a", [1]]}, 400, "prompt"),  # a batch may not mix strings and ids
        (parse_completion, {"prompt": [1, "a"]}, 400, "prompt"),
        (parse_completion, {"prompt": "a", "top_k": -2}, 400, "top_k"),
        (parse_completion, {"prompt": "a", "stop": 3}, 400, "stop"),
        (parse_completion, {"prompt": "a", "seed": 1.5}, 400, "seed"),
        (
            parse_chat,
            {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
        ),
        (parse_generate, {"prompt": "a", "max_new_tokens": "5"}, 400, "max_new_tokens"),
        (parse_completion, {"prompt": "a", "best_of": 2}, 400, "best_of"),
        (parse_completion, {"prompt": "a", "best_of": True}, 400, "best_of"),  # True == 1 in Python, not in JSON
        (parse_completion, {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
        (parse_completion, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        (parse_completion, {"prompt": "a", "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "min_p": 2}, 400, "min_p"),
        (parse_generate, {"prompt": "a", "n": 2}, 400, "n"),
        (
            parse_completion,
            {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}},
            400,
            "stream_options.include_usage",
        ),
        (parse_completion, {"prompt": "a", "model": "gpt-4"}, 404, "model"),
        (parse_chat, {"messages": ["hi"]}, 400, "messages[0]"),
        (parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]"),
        (parse_chat, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
        (parse_chat, {"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages[0].content[0]"),
        (parse_chat, {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),  # OpenAI's 400
        (parse_chat, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": []}]}, 400,
         "messages[1].content"),
        (parse_chat, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, 400,
         "tools[0].function"),  # the tool's own fault first, before this model's template (which renders none)
        (parse_chat, {"messages": [{"role": "user", "content": "a"}],
                      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "logprobs": "yes"}, 400, "logprobs"),
        # OpenAI's optional labels and flags, of the wrong kind: accepted silently, they were
        (parse_chat, {"messages": [{"role": "user", "content": "a", "name": 7}]}, 400, "messages[0].name"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": ["x"], "schema": {}}}}, 400,
         "response_format.json_schema.name"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}}, 400,
         "response_format.json_schema.strict"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {
            "name": "f", "description": {"text": "x"}}}]}, 400, "tools[0].function.description"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {
            "name": "f", "strict": "true"}}]}, 400, "tools[0].function.strict"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": "x"}}}]}, 400,
         "tools[0].function.parameters.properties"),
        (parse_chat, {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"properties": {"a": {"type": "string"}}, "required": "a"}}}]}, 400,
         "tools[0].function.parameters.required"),
        (parse_generate, {"prompt": "a", "stop_on_eos": "no"}, 400, "stop_on_eos"),
    ],
)
def test_bad_fields_name_their_param(info, parse, body, status, param):
    e = error_of(parse, body, info)
    assert (e.status, e.param) == (status, param)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"} and e.message


def test_engine_errors_become_400s_naming_the_requests_field():
    e = invalid_request(InvalidParameter("prompt", "the prompt is empty", "invalid_value"))
    assert (e.status, e.param, e.code, e.message) == (400, "prompt", "invalid_value", "the prompt is empty")
    # The engine names its own field; the request's name for it may differ (chat's prompt is its messages).
    e = invalid_request(
        InvalidParameter("max_tokens", "too long", "context_length_exceeded"), {"max_tokens": "max_new_tokens"}
    )
    assert (e.param, e.code) == ("max_new_tokens", "context_length_exceeded") and "'max_new_tokens'" in e.message
    assert invalid_request(ValueError("something else went wrong")).param is None


def test_prompts_are_parsed_not_judged(info):
    # Whether ids fit the vocabulary and the context is the engine's to say (check_request, tested in test_serve).
    req = parse_completion({"prompt": list(range(64))}, info)
    assert req.prompt_token_ids == list(range(64)) and req.params.max_tokens == 1  # the default keeps max_tokens valid
    assert parse_chat({"messages": [{"role": "user", "content": "a"}]}, info).fields["prompt"] == "messages"


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'{"a": NaN}', b"\xff\xfe", b'"text"'])
def test_parse_json_body_rejects_non_objects(raw):
    assert error_of(parse_json_body, raw).status == 400


@pytest.mark.parametrize("raw, param", [
    (rb'{"prompt": "\ud800 hi"}', "prompt"),
    (rb'{"messages": [{"role": "user", "content": "a\udc00"}]}', "messages[0].content"),
    (rb'{"stop": ["x", "\udfff"]}', "stop[1]"),
    (rb'{"\ud83d": 1}', "body"),  # half a pair, as a key
])
def test_a_lone_surrogate_is_a_400_naming_where(raw, param):
    """JSON may escape a UTF-16 surrogate, and Python decodes one alone into a str no tokenizer can take (it was
    a 500). A pair is one character, and passes."""
    e = error_of(parse_json_body, raw)
    assert (e.status, e.param) == (400, param) and "surrogate" in e.message
    pair_and_escaped_backslash = rb'{"prompt": "\ud83d\ude00 and \\ud800 as text"}'
    assert parse_json_body(pair_and_escaped_backslash) == {"prompt": "\U0001f600 and \\ud800 as text"}


def output(text="ab", reason="length") -> RequestOutput:
    return RequestOutput("0", prompt_token_ids=[1, 2, 3], token_ids=[4, 5], text=text, finish_reason=reason)


def responder(info, chat: bool) -> Responder:
    return Responder("tiny", chat, ParsedRequest([[1, 2, 3]], SamplingParams()), info.tokenizer)


def test_completion_response_and_chunks(info):
    r = responder(info, chat=False)
    body = r.response([(output(),)])
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert r.first_chunks() == []
    assert r.delta_chunks(CompletionDelta(0, [4], "a"))[0]["choices"][0]["text"] == "a"
    assert r.delta_chunks(CompletionDelta(0, [5], "", "stop"))[0]["choices"][0]["finish_reason"] == "stop"
    usage = r.usage_chunk([(output(),)])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5


def test_chat_response_and_chunks(info):
    r = responder(info, chat=True)
    body = r.response([(output("hi", "stop"),)])
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    [first] = r.first_chunks()
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    assert r.delta_chunks(CompletionDelta(0, [4], "x"))[0]["choices"][0]["delta"] == {"content": "x"}
    assert r.delta_chunks(CompletionDelta(0, [5], "", "length"))[0]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    json.dumps(r.usage_chunk([(output(),)]))  # every chunk is plain JSON


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert histogram_lines("x", h) == [
        'x_bucket{le="0.1"} 2',
        'x_bucket{le="1.0"} 3',
        'x_bucket{le="+Inf"} 4',
        "x_sum 3.65",
        "x_count 4",
    ]


def test_metrics_render_counts_finished_requests():
    m = Metrics()
    out = output()
    out.arrival_time, out.first_token_time, out.token_times, out.finish_time = 1.0, 1.5, [1.5, 1.7], 1.7
    m.on_admitted(3)
    m.on_tokens(2)
    m.on_first_token(0.5)
    m.on_finished(out)
    text = render(m, {"num_running": 2, "num_kv_blocks_free": 7, "num_kv_blocks_total": 9})
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert values["minfer_requests_running"] == "2" and values["minfer_kv_blocks_free"] == "7"
    assert values["minfer_requests_finished_total"] == "1" and values["minfer_prompt_tokens_total"] == "3"
    assert values["minfer_generation_tokens_total"] == "2"
    assert values["minfer_time_to_first_token_seconds_count"] == "1"
    assert float(values["minfer_time_to_first_token_seconds_sum"]) == pytest.approx(0.5)
    assert float(values["minfer_time_per_output_token_seconds_sum"]) == pytest.approx(0.2)
    assert float(values["minfer_e2e_request_latency_seconds_sum"]) == pytest.approx(0.7)
    assert values['minfer_e2e_request_latency_seconds_bucket{le="0.5"}'] == "0"
    assert values['minfer_e2e_request_latency_seconds_bucket{le="1.0"}'] == "1"


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(info):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk carries its choice's usage so
    far. It was logged and ignored: a field accepted and not applied."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    req = parse_chat({"messages": [{"role": "user", "content": "a"}], "stream": True, "stream_options": options}, info)
    r = Responder("tiny", True, req, info.tokenizer)
    prompt_tokens = len(req.prompt_token_ids)
    [first] = r.first_chunks()
    assert first["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    r.delta_chunks(CompletionDelta(0, [4, 5], "xy"))
    [last] = r.delta_chunks(CompletionDelta(0, [6], "", "stop"))
    assert last["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3}
    plain = parse_chat({"messages": [{"role": "user", "content": "a"}], "stream": True,
                        "stream_options": {"include_usage": True}}, info)
    assert "usage" not in Responder("tiny", True, plain, info.tokenizer).first_chunks()[0]
    bad = {"include_usage": True, "continuous_usage_stats": "yes"}
    e = error_of(parse_completion, {"prompt": "a", "stream": True, "stream_options": bad}, info)
    assert (e.status, e.param) == (400, "stream_options.continuous_usage_stats")
