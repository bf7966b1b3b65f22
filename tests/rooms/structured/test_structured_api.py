"""Structured outputs over HTTP: response_format (the openai SDK's `parse`), vLLM's structured_outputs and
guided_* fields on /v1/completions and /v1/chat/completions, streamed and not; Qwen3 chat rendered without
thinking under a constraint; every bad input a 400 naming its field, while the server keeps serving."""

import http.client
import json

import openai
import pydantic
import pytest
from serving import serving, texts_by_index, wait_all_free
from structured_constraints import meets

from minfer import EngineConfig
from minfer.server.chat_requests import parse_chat
from minfer.server.requests import ModelInfo, parse_completion
from minfer.text.chat_template import ChatTemplate
from minfer.text.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Tell me about a pet."}]
PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
       "required": ["name", "legs"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(make_checkpoint):
    config = EngineConfig(str(make_checkpoint("qwen3-tiny")), num_kv_blocks=96, max_num_batched_tokens=128)
    with serving(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0)


def post(server, path, body) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    if not body.get("stream") or resp.status != 200:
        return resp.status, json.loads(raw)
    return resp.status, [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
                         for line in raw.splitlines() if line.startswith("data: ")]


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    legs: int = pydantic.Field(ge=0, le=8)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 4}])
def test_the_openai_sdk_parses(client, server, sampling):
    completion = client.chat.completions.parse(model=server.info.name, messages=MESSAGES, response_format=Pet,
                                               max_tokens=60, **sampling)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet), choice.message.content
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content)
    wait_all_free(server)


# (endpoint, the request's fields, what the output must meet)
WAYS = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}},
     {"json": PET}),
    ("completions", {"response_format": {"type": "json_object"}}, {"json_object": True}),
    ("completions", {"structured_outputs": {"regex": r"[A-Z][a-z]{2,6} has [1-4] legs\."}},
     {"regex": r"[A-Z][a-z]{2,6} has [1-4] legs\."}),
    ("chat", {"structured_outputs": {"json": PET, "disable_any_whitespace": True}}, {"json": PET}),
    ("chat", {"guided_choice": ["cat", "dog", "hamster"]}, {"choice": ["cat", "dog", "hamster"]}),
    ("completions", {"guided_regex": r"[0-9]{2}:[0-9]{2}"}, {"regex": r"[0-9]{2}:[0-9]{2}"}),
    ("chat", {"guided_json": json.dumps(PET), "guided_whitespace_pattern": " ?"}, {"json": PET}),
    ("completions", {"guided_grammar": 'start: "a" /[0-9]{2}/ "z"'}, {"regex": r"a[0-9]{2}z"}),
]


@pytest.mark.parametrize("endpoint, fields, wanted", WAYS, ids=[f"{e}-{'+'.join(f)}" for e, f, _ in WAYS])
def test_each_way_to_ask_streamed_and_not(server, endpoint, fields, wanted):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "My pet"}
    body |= {"max_tokens": 80, "temperature": 0.8, "seed": 11, "n": 2, **fields}
    status, out = post(server, path, body)
    assert status == 200, out
    texts = [c["message"]["content"] if endpoint == "chat" else c["text"] for c in out["choices"]]
    reasons = [c["finish_reason"] for c in out["choices"]]
    if wanted.get("json_object"):  # any object: keys and strings without end, which a random model seldom ends
        assert all(t.startswith("{") for t in texts)
        assert all(meets(wanted, t) for t, r in zip(texts, reasons) if r == "stop")
    else:
        assert reasons == ["stop", "stop"] and all(meets(wanted, t) for t in texts), texts
    status, events = post(server, path, {**body, "stream": True})
    streamed, finishes = texts_by_index(events)
    assert status == 200 and streamed == dict(enumerate(texts)) and finishes == dict(enumerate(reasons))
    wait_all_free(server)


def test_logprobs_and_stop_compose_over_http(server):
    body = {"prompt": "My pet", "max_tokens": 20, "temperature": 0, "logprobs": 2, "stop": [" "],
            "structured_outputs": {"choice": ["big dog", "small cat"]}}
    status, out = post(server, "/v1/completions", body)
    choice = out["choices"][0]
    assert status == 200 and choice["text"] in ("big", "small") and choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["tokens"]) == out["usage"]["completion_tokens"] > 0


BAD = [  # (endpoint, fields, the param the 400 names, words in its message)
    ("chat", {"response_format": "json"}, "response_format", "must be an object"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": PET}}},  # OpenAI requires it
     "response_format.json_schema.name", "Missing required parameter"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "my pet", "schema": PET}}},
     "response_format.json_schema.name", "letters, digits"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "p" * 65, "schema": PET}}},
     "response_format.json_schema.name", "1 to 64"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ("completions", {"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ("completions", {"guided_regex": "[0-9"}, "guided_regex", "regex"),
    ("chat", {"guided_choice": []}, "guided_choice", "empty"),
    ("chat", {"structured_outputs": {"choice": []}}, "structured_outputs", "empty"),
    ("chat", {"guided_choice": ["a", 1]}, "guided_choice", "list of strings"),
    ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "both"),
    ("completions", {"guided_json": PET, "guided_regex": "a"}, "guided_regex", "both"),
    ("completions", {"structured_outputs": {"json": PET, "regex": "a"}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ("completions", {"structured_outputs": ["regex"]}, "structured_outputs", "must be an object"),
    ("completions", {"guided_grammar": "start: x y"}, "guided_grammar", "grammar"),
    ("completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON schema"),
    ("completions", {"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend",
     "not supported"),
    # bounds past what llguidance takes: the keyword and its range named, not its "not JSON serializable"
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 1e20}}}}, "response_format", "'minimum' is 1e+20, a bound the grammar engine"),
    ("completions", {"guided_json": {"type": "object", "properties": {"n": {"type": "integer",
                                                                            "maximum": 10**20}}}},
     "guided_json", "'properties.n.maximum' is 100000000000000000000, outside the integers the grammar engine takes"),
    ("completions", {"guided_json": {"type": "number", "maximum": -1e19}}, "guided_json", "between -10^18 and 10^18"),
]


@pytest.mark.parametrize("endpoint, fields, param, words", BAD, ids=[f"{p}-{i}" for i, (_, _, p, _) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, endpoint, fields, param, words):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": "My pet"}
    status, out = post(server, path, {**body, "max_tokens": 8, **fields})
    assert status == 400 and out["error"]["param"] == param, out
    assert words in out["error"]["message"], out["error"]["message"]
    assert post(server, path, {**body, "max_tokens": 2})[0] == 200  # and it keeps serving
    wait_all_free(server)


@pytest.mark.parametrize("spec", [{"name": "anything"}, {"name": "anything", "schema": None}])
def test_a_json_schema_without_its_schema_holds_the_reply_to_json(server, spec):
    """OpenAI's API makes json_schema.schema optional. Without one, the reply is any JSON (the empty schema),
    as the type asks: it had been a 400 saying the schema was required (vLLM would leave the reply free)."""
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": spec}}
    status, out = post(server, "/v1/chat/completions", body)
    assert status == 200, out
    [choice] = out["choices"]
    assert choice["finish_reason"] == "stop", choice
    json.loads(choice["message"]["content"])
    wait_all_free(server)


THINKING = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}")


@pytest.mark.parametrize("fields, thinks", [
    ({}, True),
    ({"response_format": {"type": "json_object"}}, False),
    ({"guided_regex": "a", "chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"response_format": {"type": "text"}}, True),
])
def test_constrained_chat_renders_without_thinking_unless_asked(tiny_checkpoint, fields, thinks):
    info = ModelInfo("m", Tokenizer.from_dir(tiny_checkpoint), 512, chat_template=ChatTemplate(THINKING))
    req = parse_chat({"messages": MESSAGES, **fields}, info)
    assert ("<think>" in info.tokenizer.decode(req.prompt_token_ids)) == thinks


def test_the_engine_names_the_requests_own_field(tiny_checkpoint):
    """A schema the engine refuses later is reported under the field the request used."""
    info = ModelInfo("m", Tokenizer.from_dir(tiny_checkpoint), 512)
    for name, value in (("guided_json", PET), ("response_format", {"type": "json_object"})):
        req = parse_completion({"prompt": "a", name: value}, info)
        assert req.fields["structured_outputs"] == name and req.params.structured_outputs is not None
    assert parse_completion({"prompt": "a"}, info).params.structured_outputs is None
