"""Tool calling through the openai SDK on random Qwen3 and Llama checkpoints whose chat templates render
tools (minfer's random-checkpoint writer, tools=True): tool_choice "required" and a named function are held
to a grammar, so their calls parse and their arguments validate, streamed and not, greedy and sampled; a
conversation with a tool message continues; "none" is content; "auto" is content or calls, never half of
one; every bad input is a 400 naming its field."""

import http.client
import json
from functools import partial

import jsonschema
import openai
import pydantic
import pytest
from serving import serving, wait_all_free

from minfer import EngineConfig
from minfer.server.chat_requests import parse_chat
from minfer.structured.grammars import Grammars
from minfer.server.requests import ModelInfo
from minfer.text.chat_template import ChatTemplate
from minfer.text.tokenizer import Tokenizer
from minfer.errors import InvalidParameter
from minfer.server.tool_calls import HERMES, LLAMA3_JSON, CallStream, format_of, read
from minfer.server.tools import Tools

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"], "properties": {
    "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "maxProperties": 0}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLING = [{"temperature": 0}, {"temperature": 0.9, "seed": 3}]


@pytest.fixture(scope="module", params=["qwen3-tiny", "llama-tiny"])
def server(request, make_checkpoint):
    path = make_checkpoint(request.param, tools=True, max_position_embeddings=2048)
    with serving(EngineConfig(str(path), num_kv_blocks=256, max_num_batched_tokens=512)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0)


def create(client, server, **fields):
    return client.chat.completions.create(model=server.info.name, **{"messages": ASK, "max_tokens": 120, **fields})


def streamed(client, server, **fields) -> tuple[str, list[tuple[str, str, str]], str]:
    """A streamed reply as the SDK's chunks carry it: (content, [(id, name, arguments)], finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in create(client, server, stream=True, **fields):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # the header comes first: index, id and name
                    assert d.index not in calls and d.function.name
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    calls[d.index][2] += d.function.arguments
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def assert_valid(calls, names):
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_enforced_calls_parse_and_validate_streamed_and_not(client, server, choice, sampling):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    names = [t["function"]["name"] for t in TOOLS] if choice == "required" else [choice]
    reply = create(client, server, tools=TOOLS, tool_choice=tool_choice, **sampling).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert_valid(calls, names)
    assert all(c.type == "function" and c.id.startswith("call_") for c in reply.message.tool_calls)
    content, stream_calls, finish = streamed(client, server, tools=TOOLS, tool_choice=tool_choice, **sampling)
    assert content == "" and finish == "tool_calls"
    assert [(name, arguments) for _, name, arguments in stream_calls] == calls  # the same, fragment by fragment
    wait_all_free(server)


def test_a_closing_tag_in_an_enforced_argument_is_the_same_call_streamed_and_not(client, server):
    """An argument may hold the format's closing tag as text: the call is still one call, streamed or not."""
    say = {"type": "object", "additionalProperties": False, "required": ["s"],
           "properties": {"s": {"const": "a</tool_call>b"}}}
    tools = [{"type": "function", "function": {"name": "say", "parameters": say}}]
    fields = {"tools": tools, "tool_choice": "required", "temperature": 0, "max_tokens": 200}
    reply = create(client, server, **fields).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None, reply
    [call] = reply.message.tool_calls
    assert json.loads(call.function.arguments) == {"s": "a</tool_call>b"}
    content, calls, finish = streamed(client, server, **fields)
    assert (content, [(name, arguments) for _, name, arguments in calls], finish) == \
        ("", [("say", call.function.arguments)], "tool_calls")


def test_stop_strings_do_not_cut_an_enforced_call(client, server):
    """Stop strings end a reply's text, and an enforced reply is calls only: a stop string the call writes
    ('"b"', add's second key) does not cut it in half (vLLM's would, into arguments no client can run). The
    same stop string ends an "auto" reply's text."""
    fields = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}, "stop": ['"b"'],
              "temperature": 0}
    reply = create(client, server, **fields).choices[0]
    [call] = reply.message.tool_calls
    assert reply.finish_reason == "tool_calls" and '"b"' in call.function.arguments
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    content, calls, finish = streamed(client, server, **fields)
    assert (content, [(name, arguments) for _, name, arguments in calls], finish) == \
        ("", [("add", call.function.arguments)], "tool_calls")
    text = create(client, server, tools=TOOLS, stop=['"b"'], temperature=0,  # "auto": text, which it ends
                  extra_body={"structured_outputs": {"regex": 'x"b"y'}}).choices[0]
    assert (text.message.content, text.finish_reason) == ("x", "stop")


def test_a_stop_string_that_cuts_an_auto_call_leaves_its_text_as_content(client, server):
    """Under "auto", stop strings act on the reply as the model writes it. Held by a choice to one whole call,
    the reply is that call; a stop string inside it ('"b"') cuts it, and what is left comes back as content with
    finish_reason "stop", never as half a call (arguments no client could run), streamed and not."""
    fmt = format_of(server.info.chat_template)
    body = f'{{"name": "add", "{fmt.arguments}": {{"a": 1, "b": 2}}}}'
    call = f"{fmt.open}\n{body}\n{fmt.close}" if fmt.open else body
    fields = {"tools": TOOLS, "temperature": 0, "extra_body": {"structured_outputs": {"choice": [call]}}}
    whole = create(client, server, **fields).choices[0]
    assert whole.finish_reason == "tool_calls" and [(c.function.name, json.loads(c.function.arguments))
                                                    for c in whole.message.tool_calls] == [("add", {"a": 1, "b": 2})]
    cut = create(client, server, stop=['"b"'], **fields).choices[0]
    text = call[: call.index('"b"')].strip()
    assert (cut.message.content, cut.message.tool_calls, cut.finish_reason) == (text, None, "stop")
    assert streamed(client, server, stop=['"b"'], **fields) == (text, [], "stop")
    wait_all_free(server)


STRICT = [{"type": "function", "function": {**TOOLS[1]["function"], "strict": True}}, TOOLS[2]]


@pytest.mark.parametrize("parallel", [True, False])
def test_strict_tools_hold_an_auto_replys_calls(server, parallel):
    """Under "auto", a strict tool's calls validate against its parameters, as OpenAI's do: the reply is held
    to text whose calls are calls to the tools (a strict one's arguments its parameters', another's any
    object); without parallel_tool_calls, one call at most."""
    info, fmt = server.info, format_of(server.info.chat_template)
    params = parse_chat({"messages": ASK, "tools": STRICT, "parallel_tool_calls": parallel}, info).params
    grammars = Grammars(info.tokenizer, info.tokenizer.vocab_size)

    def takes(text):
        matcher = grammars.matcher(params.structured_outputs)
        return matcher.consume_tokens(info.tokenizer.encode(text)) and matcher.is_accepting()

    def call(name, arguments):
        body = json.dumps({"name": name, fmt.arguments: arguments})
        return f"{fmt.open}\n{body}\n{fmt.close}" if fmt.open else body

    first, second = call("add", {"a": 1, "b": 2}), call("now", {"x": [1]})
    assert takes("No call: just text, {braces} and all.")
    assert takes(("Let me add. " if fmt.open else "") + first)
    assert takes(first + (fmt.separator if not fmt.open else "\n") + second) == parallel
    assert not takes(call("add", {"a": 1, "b": 200})) and not takes(call("add", {"a": 1}))  # not add's parameters
    assert not takes(call("fly", {}))  # not a tool
    loose = parse_chat({"messages": ASK, "tools": TOOLS}, info).params  # no strict tool: nothing is enforced
    assert loose.structured_outputs is None


@pytest.mark.parametrize("parallel", [None, True, False])
def test_a_named_function_is_called_exactly_once(server, parallel):
    """OpenAI's forced function is one call of it (vLLM's too): parallel_tool_calls, true by default, lets
    "required" make several calls, not a named function call it twice."""
    info, fmt = server.info, format_of(server.info.chat_template)
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    params = parse_chat({**body, **({} if parallel is None else {"parallel_tool_calls": parallel})}, info).params
    grammars = Grammars(info.tokenizer, info.tokenizer.vocab_size)

    def takes(text):
        matcher = grammars.matcher(params.structured_outputs)
        return matcher.consume_tokens(info.tokenizer.encode(text)) and matcher.is_accepting()

    call = json.dumps({"name": "add", fmt.arguments: {"a": 1, "b": 2}})
    call = f"{fmt.open}\n{call}\n{fmt.close}" if fmt.open else call
    assert takes(call) and not takes(call + fmt.separator + call)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)


class Trip(pydantic.BaseModel):  # the SDK writes its parameters with City under $defs, and a $ref to it
    to: City
    days: int = pydantic.Field(ge=1, le=7)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Trip"}}])
def test_a_pydantic_tool_with_defs_is_enforced_and_parses(client, server, choice):
    """openai.pydantic_function_tool writes a nested model under $defs, referred to as "#/$defs/City" from
    the tool's parameters: the grammar holds them where they stand inside it, so they compile and the SDK
    parses the call."""
    tools = [openai.pydantic_function_tool(Trip)]
    for seed in range(3):
        reply = client.chat.completions.parse(model=server.info.name, messages=ASK, tools=tools, tool_choice=choice,
                                              max_tokens=120, temperature=1.0, seed=seed).choices[0]
        assert reply.finish_reason == "tool_calls"
        assert all(isinstance(call.function.parsed_arguments, Trip) for call in reply.message.tool_calls), reply
    wait_all_free(server)


def a_call_is_taken(server, params, name: str, arguments) -> bool:
    """Whether the reply's grammar (`params`) takes one call of `name` with these arguments, whole."""
    info, fmt = server.info, format_of(server.info.chat_template)
    body = json.dumps({"name": name, fmt.arguments: arguments})
    matcher = Grammars(info.tokenizer, info.tokenizer.vocab_size).matcher(params.structured_outputs)
    text = f"{fmt.open}\n{body}\n{fmt.close}" if fmt.open else body
    return matcher.consume_tokens(info.tokenizer.encode(text)) and matcher.is_accepting()


def test_a_strict_tools_defs_hold_an_auto_replys_calls(server):
    """Under "auto" the pydantic tool is strict: its calls are held to its parameters, $defs and all."""
    params = parse_chat({"messages": ASK, "tools": [openai.pydantic_function_tool(Trip)]}, server.info).params
    takes = partial(a_call_is_taken, server, params, "Trip")
    assert takes({"to": {"name": "Rome"}, "days": 3})
    assert not takes({"to": {"name": "Rome", "x": 1}, "days": 3})
    assert not takes({"to": {"name": "Barcelona"}, "days": 3})


@pytest.mark.parametrize("parameters", [{}, {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}])
def test_parameters_without_a_type_are_still_an_object(server, parameters):
    """A tool's parameters describe its arguments, which OpenAI's calls always hold as an object: parameters
    that leave out `"type": "object"` (as a bare {} does) hold an enforced call's arguments to an object
    still, never a number or a string that no client could read as arguments."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    params = parse_chat({"messages": ASK, "tools": tools, "tool_choice": "required"}, server.info).params
    takes = partial(a_call_is_taken, server, params, "f")
    assert takes({"a": 1})
    assert not any(map(takes, [1, "a", None, True, [1]]))


def test_strict_tools_leave_an_auto_replys_text_free(client, server):
    """A reply held to strict tools that writes no call is content, as without them; a response_format
    goes first (it leaves no room for a call)."""
    reply = create(client, server, tools=STRICT, temperature=0, max_tokens=20).choices[0]
    assert reply.message.tool_calls is None and reply.message.content
    ids = parse_chat({"messages": ASK, "tools": STRICT}, server.info).prompt_token_ids
    free = client.completions.create(model=server.info.name, prompt=ids, temperature=0, max_tokens=20,
                                     extra_body={"structured_outputs": {"regex": "(.|\n)*"}})  # any valid UTF-8
    assert reply.message.content == free.choices[0].text.strip()  # the mask took no text but a call's opening
    formatted = create(client, server, tools=STRICT, temperature=0, max_tokens=40,
                       response_format={"type": "json_object"}).choices[0]
    assert formatted.finish_reason == "length" or isinstance(json.loads(formatted.message.content), dict)
    wait_all_free(server)


def test_parallel_tool_calls_false_holds_one_call_each(client, server):
    out = create(client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=3,
                 temperature=1.0, seed=7)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_valid([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], SCHEMAS)


def test_a_conversation_with_a_tool_message_renders_and_continues(client, server):
    first = create(client, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}]
    reply = create(client, server, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > create(client, server, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    again = create(client, server, messages=history, tools=TOOLS, tool_choice="required", temperature=0)
    assert_valid([(c.function.name, c.function.arguments) for c in again.choices[0].message.tool_calls], SCHEMAS)


def test_none_renders_no_tools_and_returns_content(client, server):
    reply = create(client, server, tools=TOOLS, tool_choice="none", max_tokens=10, temperature=0)
    plain = create(client, server, max_tokens=10, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content == \
        plain.choices[0].message.content
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools were not rendered


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
def test_auto_is_content_or_calls_never_half_a_call(client, server, sampling):
    reply = create(client, server, tools=TOOLS, tool_choice="auto", max_tokens=40, **sampling).choices[0]
    content, calls, finish = streamed(client, server, tools=TOOLS, tool_choice="auto", max_tokens=40, **sampling)
    if reply.message.tool_calls:
        assert_valid([(c.function.name, c.function.arguments) for c in reply.message.tool_calls], SCHEMAS)
    else:
        assert reply.message.content == content and not calls
    assert finish == reply.finish_reason


def post(server, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return resp.status, out


ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "3"}


def called(call: dict) -> dict:
    """An assistant message that called add (id c1), with `call`'s fields in place of its own."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}, **call}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


CALLED_TWICE = {"role": "assistant", "content": None, "tool_calls": [
    called({})["tool_calls"][0], called({"id": "c2", "function": {"name": "now", "arguments": "{}"}})["tool_calls"][0]]}

NOPE = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                     "properties": {"x": {"type": "nope"}}}}}
BAD = [  # (fields, the param the 400 names, words in its message)
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "an object"}}]},
     "tools[0].function.parameters", "JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "JSON schema"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "two tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "fly"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "'tools'"),
    ({"function_call": "auto"}, "function_call", "'tools'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice"),
    # an enforced tool's schema that does not compile: the tool's own field, and the reason without the grammar
    ({"tools": [TOOLS[1], NOPE], "tool_choice": "required"}, "tools[1].function.parameters",
     "'tools[1].function.parameters' is invalid: the json does not compile: Invalid type: nope"),
    ({"tools": [TOOLS[1], NOPE], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[1].function.parameters", "Invalid type: nope"),
    ({"tools": [TOOLS[1], {**NOPE, "function": {**NOPE["function"], "strict": True}}]},
     "tools[1].function.parameters", "Invalid type: nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1e20}}}}}], "tool_choice": "required"}, "tools[0].function.parameters",
     "'properties.n.minimum' is 1e+20, a bound the grammar engine cannot write a number's pattern for"),
    ({"messages": [*ASK, {"role": "tool", "content": "sunny"}], "tools": TOOLS}, "messages[1].tool_call_id",
     "tool_call_id"),
    ({"messages": [*ASK, called({"function": {"name": "add"}})], "tools": TOOLS},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [*ASK, called({"function": {"name": "add", "arguments": "{'a': 1}"}}), ANSWER], "tools": TOOLS},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [*ASK, called({"function": {"name": "add", "arguments": "[1]"}})], "tools": TOOLS},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [*ASK, called({"id": None}), ANSWER], "tools": TOOLS}, "messages[1].tool_calls[0].id", "id"),
    ({"messages": [*ASK, called({"function": {"arguments": "{}"}})], "tools": TOOLS},
     "messages[1].tool_calls[0].function.name", "name"),
    ({"messages": [*ASK, called({"type": "retrieval"})], "tools": TOOLS}, "messages[1].tool_calls[0].type",
     "'function'"),
    ({"messages": [*ASK, called({}), {**ANSWER, "tool_call_id": "c2"}], "tools": TOOLS}, "messages[2].tool_call_id",
     "no tool call"),
    ({"messages": [*ASK, ANSWER, called({})], "tools": TOOLS}, "messages[1].tool_call_id", "no tool call"),
    # OpenAI's order: an assistant's calls are answered by the tool messages right after it, each of them
    ({"messages": [*ASK, called({}), {"role": "user", "content": "and?"}], "tools": TOOLS}, "messages[2].role",
     "No tool message answers c1"),
    ({"messages": [*ASK, called({})], "tools": TOOLS}, "messages[1].tool_calls", "No tool message answers c1"),
    ({"messages": [*ASK, CALLED_TWICE, ANSWER, *ASK], "tools": TOOLS}, "messages[3].role",
     "No tool message answers c2"),
    ({"messages": [*ASK, called({}), ANSWER, *ASK, ANSWER], "tools": TOOLS}, "messages[4].tool_call_id",
     "no tool call"),  # an answer to an earlier turn's call, after a user message
    ({"messages": [*ASK, {"role": "assistant", "content": "Hi", "tool_calls": []}, *ASK], "tools": TOOLS},
     "messages[1].tool_calls", "empty list"),
    # one call, two results: which the model should read was unsaid (both were rendered)
    ({"messages": [*ASK, called({}), ANSWER, ANSWER], "tools": TOOLS}, "messages[3].tool_call_id", "already answers"),
    ({"messages": [*ASK, {**CALLED_TWICE, "tool_calls": [called({})["tool_calls"][0]] * 2}, ANSWER], "tools": TOOLS},
     "messages[1].tool_calls[1].id", "its own"),
]


@pytest.mark.parametrize("fields, param, words", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, fields, param, words):
    status, out = post(server, {"messages": ASK, "max_tokens": 4, **fields})
    assert status == 400 and out["error"]["param"] == param, out
    assert words in out["error"]["message"] and "%json" not in out["error"]["message"], out["error"]["message"]
    assert post(server, {"messages": ASK, "max_tokens": 2})[0] == 200  # and it keeps serving
    wait_all_free(server)


def test_a_template_gets_a_calls_arguments_as_an_object(make_checkpoint):
    """As transformers and vLLM hand them over: Llama 3.1's template writes `arguments | tojson`, which made
    a JSON string of the text OpenAI sends. No arguments ("") are an empty object."""
    tokenizer = Tokenizer.from_dir(make_checkpoint("qwen3-tiny", tools=True))
    template = ChatTemplate("{{ tools | length }}{% for m in messages %}{% for c in m.tool_calls or [] %}"
                            "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    info = ModelInfo("q", tokenizer, 512, template)
    messages = [*ASK, called({}), ANSWER, called({"id": "c2", "function": {"name": "now", "arguments": ""}}),
                {**ANSWER, "tool_call_id": "c2"}]
    prompt = parse_chat({"messages": messages, "tools": TOOLS, "max_tokens": 1}, info).prompt_token_ids
    assert tokenizer.decode(prompt) == '3{"a": 1}{}'


def test_a_template_without_tools_says_so(make_checkpoint):
    with serving(EngineConfig(str(make_checkpoint("qwen3-tiny")), num_kv_blocks=64)) as srv:
        status, out = post(srv, {"messages": ASK, "tools": TOOLS, "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "tools" and "template" in out["error"]["message"]
        assert post(srv, {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})[0] == 200
        # A malformed tool is named first: the client's to fix, whatever this template renders.
        status, out = post(srv, {"messages": ASK, "tools": [{"type": "function"}], "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "tools[0].function", out
        # A call in the history would vanish from the prompt: refused, not dropped.
        status, out = post(srv, {"messages": [*ASK, called({})], "max_tokens": 2})
        assert status == 400 and out["error"]["param"] == "messages[1].tool_calls", out
        assert "does not render tool calls" in out["error"]["message"]


# ---- reading calls back, without a model ----------------------------------------------------------

NAMES = {"get_weather", "add"}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": "}"}}}\n</tool_call>'
TAG_IN_ARGUMENT = '<tool_call>\n{"name": "add", "arguments": {"a": "x</tool_call>\\"y"}}\n</tool_call>'


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, "Just text.", "Just text.", []),
    (HERMES, CALL, "", [("add", '{"a": 1, "b": {"c": "}"}}')]),
    (HERMES, "Let me add.\n" + CALL + "\n" + CALL, "Let me add.", [("add", '{"a": 1, "b": {"c": "}"}}')] * 2),
    (HERMES, '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>',  # no such tool: content, whole
     '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>', []),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>',  # bad JSON: content
     '<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>', []),
    (HERMES, 'Hi <tool_call>\n{"name": "add", "argu', 'Hi <tool_call>\n{"name": "add", "argu', []),  # cut by length
    (HERMES, TAG_IN_ARGUMENT + " Done.", "Done.", [("add", '{"a": "x</tool_call>\\"y"}')]),  # a tag in a string
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": "1}\n</tool_call>',  # a stray quote: the first tag
     '<tool_call>\n{"name": "add", "arguments": {"a": "1}\n</tool_call>', []),
    (LLAMA3_JSON, '{"name": "add", "parameters": {"a": 2}}; {"name": "get_weather", "parameters": {}}', "",
     [("add", '{"a": 2}'), ("get_weather", "{}")]),
    (LLAMA3_JSON, 'The answer is {"name": "add", "parameters": {}}', 'The answer is {"name": "add", "parameters": {}}',
     []),
    # JSON that is no call is content, whole: the text between two such blocks, or after one, is its own
    (LLAMA3_JSON, '{"a": 1}\n\n{"b": 2}', '{"a": 1}\n\n{"b": 2}', []),
    (LLAMA3_JSON, '{"a": 1} and {"b": 2}; {"c": 3}', '{"a": 1} and {"b": 2}; {"c": 3}', []),
    (LLAMA3_JSON, '{"name": "fly", "parameters": {}}; {"name": "fly", "parameters": {}}',
     '{"name": "fly", "parameters": {}}; {"name": "fly", "parameters": {}}', []),
    # beside a call, "; " is the separator of calls, not content
    (LLAMA3_JSON, '{"name": "fly", "parameters": {}}; {"name": "add", "parameters": {}}; {"b": 2}',
     '{"name": "fly", "parameters": {}}{"b": 2}', [("add", "{}")]),
])
def test_auto_replies_read_the_same_whole_and_streamed(fmt, text, content, calls):
    whole = read(fmt, text, NAMES, final=True, partial=False)
    assert (whole.content, [(c.name, c.arguments) for c in whole.calls]) == (content, calls)
    stream, got_content, got = CallStream(fmt, NAMES, partial=False), "", {}
    for i, char in enumerate(text):  # a character at a time: every prefix is read
        piece, deltas = stream.add(char, final=i == len(text) - 1)
        got_content += piece
        if deltas and fmt is HERMES:  # a call goes out once it has closed: never half of one
            assert text[: i + 1].count("</tool_call>") > len(got)
        for d in deltas:
            got.setdefault(d["index"], [d["function"].get("name"), ""])[1] += d["function"]["arguments"]
    assert got_content == content and [tuple(v) for v in got.values()] == calls


def test_an_enforced_call_reads_past_a_closing_tag_in_its_arguments():
    """Held to the grammar (partial), a call streams its arguments as they grow: "</tool_call>" inside one
    of its strings neither ends the call nor turns what was sent into content."""
    stream, got = CallStream(HERMES, NAMES, partial=True), ""
    for i, char in enumerate(TAG_IN_ARGUMENT):
        content, deltas = stream.add(char, final=i == len(TAG_IN_ARGUMENT) - 1)
        assert content == ""
        got += "".join(d["function"]["arguments"] for d in deltas)
    whole = read(HERMES, TAG_IN_ARGUMENT, NAMES, final=True, partial=True)
    assert got == whole.calls[0].arguments == '{"a": "x</tool_call>\\"y"}' and whole.content == ""


def test_content_that_may_open_a_call_is_held_back():
    stream = CallStream(HERMES, NAMES, partial=False)
    assert stream.add("Sure <tool", final=False) == ("Sure", [])  # the space waits too: a reply is stripped
    assert stream.add("kit", final=False) == (" <toolkit", [])
    stream = CallStream(LLAMA3_JSON, NAMES, partial=False)
    assert stream.add('  {"name": "add", ', final=False) == ("", [])  # a Llama 3 reply that opens with { waits


def test_tokenize_renders_tools_as_the_chat_prompt_does(client, server):
    """/tokenize with tools counts the prompt a chat completion with those tools runs."""
    def tokenize(body):
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
        conn.request("POST", "/tokenize", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = json.loads(response.read())
        conn.close()
        assert response.status == 200, data
        return data["count"]

    with_tools, without = tokenize({"messages": ASK, "tools": TOOLS}), tokenize({"messages": ASK})
    # No reply asked for: a conversation may end at calls not yet answered (with one, it is OpenAI's 400)
    assert tokenize({"messages": [*ASK, called({})], "tools": TOOLS, "add_generation_prompt": False}) > without
    assert with_tools > without
    assert with_tools == create(client, server, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert without == create(client, server, max_tokens=1).usage.prompt_tokens


def test_a_tools_grammar_no_single_tool_breaks_is_named_tools_without_the_grammar():
    """Where every held tool's parameters compile alone, the fault is the tools' together: 'tools', with llguidance's
    reason and not the grammar minfer wrote (nor its line and column in it)."""
    tools = Tools([NOPE], "required", None, True, HERMES)
    error = InvalidParameter("structured_outputs", "the grammar does not compile: at 3(7): failed to compile JSON "
                             "schema: too deep\n   1 | start: call\n   3 | body: %json {...}")
    fault = tools.fault(error, check=lambda constraint: None)
    assert (fault.param, str(fault)) == ("tools", "'tools' is invalid: the grammar does not compile: failed to compile "
                                         "JSON schema: too deep")
