"""LLM.chat's tools and its message checks are the server's: tools render into the chat template as
/v1/chat/completions renders them (the same prompt ids), and a bad message or tool is refused in the same words,
naming the same field (text/message_checks.py and text/tool_checks.py, which both call)."""

import pytest
from engine_checks import assert_all_free

from minfer import LLM, SamplingParams
from minfer.errors import InvalidParameter
from minfer.server.api_errors import APIError
from minfer.server.chat_requests import parse_chat
from minfer.server.requests import ModelInfo
from minfer.text.chat_template import ChatTemplate

GREEDY = SamplingParams(max_tokens=4, temperature=0)
ADD = {"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]
ASK = [{"role": "user", "content": "What is 1 + 2?"}]
ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "3"}
# A template that renders no tools: it never reads `tools`.
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def called(**fields) -> dict:
    """An assistant message that called add (id c1), with `fields` in place of its call's own."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}, **fields}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def tool(**function) -> dict:
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(make_checkpoint("qwen3-tiny", tools=True), num_kv_blocks=48)


def served(llm, messages, tools=None, template=None):
    """The server's chat path on these messages and tools: the ParsedRequest, or the APIError it raised."""
    template = ChatTemplate.from_dir(llm.model.model_dir, llm.tokenizer, override=template)
    body = {"messages": messages, "max_tokens": GREEDY.max_tokens, "temperature": 0}
    try:
        return parse_chat({**body, **({} if tools is None else {"tools": tools})}, ModelInfo("m", llm.tokenizer, 512,
                                                                                              template))
    except APIError as e:
        return e


def test_tools_render_as_the_server_renders_them(llm):
    """The same tools and conversation, a call and its answer in it, make the same prompt ids in both."""
    history = [*ASK, called(), ANSWER, {"role": "user", "content": "And 2 + 3?"}]
    for messages in (ASK, history):
        (out,) = llm.chat(messages, GREEDY, use_tqdm=False, tools=TOOLS)
        assert out.prompt_token_ids == served(llm, messages, TOOLS).prompts[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids)
    assert '"name": "add"' in prompt and '"name": "now"' in prompt  # the tools, as the template writes them
    assert '{"a": 1, "b": 2}' in prompt  # the call in the history, its arguments an object to the template
    (bare,) = llm.chat(ASK, GREEDY, use_tqdm=False)
    assert bare.prompt_token_ids == served(llm, ASK).prompts[0] != served(llm, ASK, TOOLS).prompts[0]
    (empty,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=[])  # no tools: as the server takes `tools: []`
    assert empty.prompt_token_ids == bare.prompt_token_ids
    assert_all_free(llm)


def test_a_strict_tool_is_refused_where_the_server_holds_the_reply_to_it(llm):
    """The server holds an "auto" reply's calls to a strict tool with a grammar; LLM.chat only renders tools, so
    it refuses `strict` rather than take it and not apply it."""
    strict = [TOOLS[0], {**TOOLS[1], "function": {**TOOLS[1]["function"], "strict": True}}]
    assert served(llm, ASK, strict).params.structured_outputs is not None  # the server applies it
    with pytest.raises(InvalidParameter, match="holds no reply") as e:
        llm.chat(ASK, GREEDY, use_tqdm=False, tools=strict)
    assert e.value.param == "tools[1].function.strict" and e.value.code == "unsupported_parameter"


FAULTS = [  # (messages, tools, template, the field named)
    (None, None, None, "messages"),
    ("hi", None, None, "messages"),
    (["hi"], None, None, "messages[0]"),
    ([*ASK, {"role": "wizard", "content": "x"}], None, None, "messages[1].role"),
    ([*ASK, {"content": "no role"}], None, None, "messages[1].role"),
    ([{"role": "user", "content": None}], None, None, "messages[0].content"),
    ([{"role": "user", "content": []}], None, None, "messages[0].content"),
    ([{"role": "user", "content": 5}], None, None, "messages[0].content"),
    ([{"role": "user", "content": ["hi"]}], None, None, "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], None, None, "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text"}]}], None, None, "messages[0].content[0].text"),
    ([{**ASK[0], "name": 7}], None, None, "messages[0].name"),
    # an assistant's calls and the tool messages that answer them
    ([*ASK, {"role": "tool", "content": "3"}], TOOLS, None, "messages[1].tool_call_id"),
    ([*ASK, {**called(), "tool_calls": "add"}], TOOLS, None, "messages[1].tool_calls"),
    ([*ASK, {**called(), "tool_calls": []}, *ASK], TOOLS, None, "messages[1].tool_calls"),
    ([*ASK, {**called(), "tool_calls": ["add"]}], TOOLS, None, "messages[1].tool_calls[0]"),
    ([*ASK, called(id=None), ANSWER], TOOLS, None, "messages[1].tool_calls[0].id"),
    ([*ASK, called(type="retrieval"), ANSWER], TOOLS, None, "messages[1].tool_calls[0].type"),
    ([*ASK, called(function="add"), ANSWER], TOOLS, None, "messages[1].tool_calls[0].function"),
    ([*ASK, called(function={"arguments": "{}"}), ANSWER], TOOLS, None, "messages[1].tool_calls[0].function.name"),
    ([*ASK, called(function={"name": "add"}), ANSWER], TOOLS, None,
     "messages[1].tool_calls[0].function.arguments"),
    ([*ASK, called(function={"name": "add", "arguments": "{'a': 1}"}), ANSWER], TOOLS, None,
     "messages[1].tool_calls[0].function.arguments"),
    ([*ASK, {**called(), "tool_calls": called()["tool_calls"] * 2}, ANSWER], TOOLS, None,
     "messages[1].tool_calls[1].id"),
    ([*ASK, called(), {**ANSWER, "tool_call_id": "c2"}], TOOLS, None, "messages[2].tool_call_id"),
    ([*ASK, called(), ANSWER, ANSWER], TOOLS, None, "messages[3].tool_call_id"),
    ([*ASK, called(), *ASK], TOOLS, None, "messages[2].role"),
    ([*ASK, called()], TOOLS, None, "messages[1].tool_calls"),
    # the tools themselves
    (ASK, "add", None, "tools"),
    (ASK, [{"type": "retrieval"}], None, "tools[0]"),
    (ASK, [{"type": "function"}], None, "tools[0].function"),
    (ASK, [tool(name="a b")], None, "tools[0].function.name"),
    (ASK, [tool(description=5)], None, "tools[0].function.description"),
    (ASK, [tool(strict="yes")], None, "tools[0].function.strict"),
    (ASK, [tool(parameters={"type": "array"})], None, "tools[0].function.parameters"),
    (ASK, [tool(parameters={"type": "object", "properties": "x"})], None, "tools[0].function.parameters.properties"),
    (ASK, [tool(parameters={"type": "object", "required": "a"})], None, "tools[0].function.parameters.required"),
    (ASK, [TOOLS[0], TOOLS[0]], None, "tools"),
    # a template that renders no tools: neither tools nor calls could reach the model
    (ASK, TOOLS, PLAIN, "tools"),
    (ASK, [{"type": "function"}], PLAIN, "tools[0].function"),  # the tool's own fault first
    ([*ASK, called()], None, PLAIN, "messages[1].tool_calls"),
    ([*ASK, ANSWER], None, PLAIN, "messages[1].tool_call_id"),
]


@pytest.mark.parametrize("messages, tools, template, param", FAULTS, ids=[f"{f[3]}-{i}" for i, f in enumerate(FAULTS)])
def test_a_bad_message_or_tool_is_refused_in_the_servers_words(llm, messages, tools, template, param):
    served_error = served(llm, messages, tools, template)
    tools = {} if tools is None else {"tools": tools}
    assert isinstance(served_error, APIError) and (served_error.status, served_error.param) == (400, param)
    with pytest.raises(InvalidParameter) as e:
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template, **tools)
    assert (e.value.param, str(e.value), e.value.code) == (param, served_error.message, served_error.code)
    if param.startswith("messages["):  # in a list of conversations, the second's fault is named within it
        with pytest.raises(InvalidParameter) as e:
            llm.chat([ASK, messages], GREEDY, use_tqdm=False, chat_template=template, **tools)
        assert e.value.param == param.replace("messages[", "messages[1][", 1)
        assert str(e.value) == served_error.message.replace("messages[", "messages[1][")
    assert_all_free(llm)
