"""LLM.chat answers a conversation in-process as the server's /v1/chat/completions does: the same prompt through
the checkpoint's chat template, ended at the end of the assistant's turn."""

import re

import pytest
from engine_checks import assert_all_free

from minfer import LLM, SamplingParams, StructuredOutputsParams
from minfer.errors import InvalidParameter
from minfer.server.chat_requests import parse_chat
from minfer.server.requests import ModelInfo
from minfer.text.chat_template import ChatTemplate

GREEDY = SamplingParams(max_tokens=12, temperature=0)
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
FOLLOW_UP = [*HELLO, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And then?"}]


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(make_checkpoint("qwen3-tiny"), num_kv_blocks=48)


def served(llm, messages):
    """What the server's chat path makes of these messages: the prompt's ids and the SamplingParams."""
    template = ChatTemplate.from_dir(llm.model.model_dir, llm.tokenizer)
    info = ModelInfo("m", llm.tokenizer, 512, template)
    req = parse_chat({"messages": messages, "max_tokens": GREEDY.max_tokens, "temperature": 0}, info)
    return req.prompts[0], req.params


def test_a_conversation_is_answered_as_the_server_answers_it(llm):
    ids, params = served(llm, HELLO)
    assert params.stop_token_ids  # the template's end of turn: the reply stops there
    (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False)
    (want,) = llm.generate([ids], params, use_tqdm=False)
    assert out.prompt_token_ids == ids and out.token_ids == want.token_ids and out.text == want.text
    assert GREEDY.stop_token_ids is None  # the caller's params are left as they were
    assert_all_free(llm)


def test_a_list_of_conversations_is_answered_in_order_each_as_alone(llm):
    alone = [llm.chat(c, GREEDY, use_tqdm=False)[0].text for c in (HELLO, FOLLOW_UP)]
    together = llm.chat([HELLO, FOLLOW_UP], GREEDY, use_tqdm=False)
    assert [o.text for o in together] == alone
    assert together[1].prompt_token_ids == served(llm, FOLLOW_UP)[0]


def test_a_template_given_and_its_variables_are_used(llm):
    template = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ greeting }}"
    (out,) = llm.chat(HELLO, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "hey"})
    assert out.prompt_token_ids == llm.tokenizer.encode("Be brief.|Hello there|hey")
    with pytest.raises(InvalidParameter) as e:  # the render's own would win over it unseen
        llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    assert e.value.param == "chat_template_kwargs.add_generation_prompt"


@pytest.mark.parametrize("given, words", [
    ("missing.jinja", "chat_template 'missing.jinja' is neither a file nor a Jinja template"),
    ("{{ messages", "chat_template '{{ messages' does not compile: unexpected end of template"),
    (b"\xff{{ x }}", "cannot be read as UTF-8 text"),
])
def test_a_bad_template_names_the_argument_not_the_servers_flag(llm, tmp_path, given, words):
    """LLM.chat's template is its `chat_template` argument: errors say so, not --chat-template (the server's)."""
    if isinstance(given, bytes):  # a file, not text
        (tmp_path / "bad.jinja").write_bytes(given)
        given = tmp_path / "bad.jinja"
    with pytest.raises(ValueError) as e:
        llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=given)
    assert str(e.value).startswith("chat_template ") and words in str(e.value), str(e.value)
    assert "--chat-template" not in str(e.value)


def test_the_reply_may_continue_the_last_message_as_the_server_s_does(llm):
    started = [*HELLO, {"role": "assistant", "content": "Well, "}]
    template = ChatTemplate.from_dir(llm.model.model_dir, llm.tokenizer)
    (out,) = llm.chat(started, GREEDY, use_tqdm=False, continue_final_message=True)  # no header: as the server
    prompt = template.render(started, False, continue_final_message=True)
    assert prompt.endswith("assistant\nWell, ") and out.prompt_token_ids == llm.tokenizer.encode(prompt)
    (closed,) = llm.chat(HELLO, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt_token_ids == llm.tokenizer.encode(template.render(HELLO, False))
    assert closed.prompt_token_ids != served(llm, HELLO)[0]  # the default opens the assistant's turn
    with pytest.raises(InvalidParameter) as e:  # both: vLLM refuses it too
        llm.chat(started, GREEDY, use_tqdm=False, add_generation_prompt=True, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    assert_all_free(llm)


@pytest.mark.parametrize("messages, param, words", [
    ("hi", "messages", "'messages' must be a list, got \"hi\""),
    (None, "messages", "'messages' is required"),
    ([{"content": "no role"}], "messages[0].role", "'messages[0].role' must be one of"),
    ([[]], "messages[0]", "'messages[0]' is empty"),  # a list of conversations, the first empty
    ([HELLO, "hi"], "messages[1]", "'messages[1]' must be a list"),
])
def test_what_is_no_conversation_is_refused_naming_where(llm, messages, param, words):
    """In the server's words (test_llm_chat_tools.py holds every check against the server's)."""
    with pytest.raises(InvalidParameter, match="^" + re.escape(words)) as e:
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert e.value.param == param


def test_no_conversations_no_outputs(llm):
    assert llm.chat([], GREEDY, use_tqdm=False) == []  # as generate([]) is


def test_a_developer_message_is_a_system_one_to_a_template_without_that_role(llm):
    developer = [{"role": "developer", "content": "Be brief."}, HELLO[1]]
    assert llm.chat(developer, GREEDY, use_tqdm=False)[0].prompt_token_ids == served(llm, HELLO)[0]


def test_content_parts_and_a_null_assistant_content_render_as_the_server_renders_them(llm):
    """OpenAI's content parts reach the template as the server hands them over, their text joined, and an
    assistant's null content as empty text. (The template got the list, or None, itself, and could not add it to
    a string.)"""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]  # one line each, as vLLM joins them
    messages = [HELLO[0], {"role": "user", "content": parts}, {"role": "assistant", "content": None},
                {"role": "user", "content": "And then?"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids == served(llm, messages)[0]
    text = llm.tokenizer.decode(out.prompt_token_ids)
    assert "Hello\nthere" in text and "None" not in text and "'type'" not in text


@pytest.mark.parametrize("content, param", [
    ([{"type": "image_url", "image_url": {"url": "x"}}], "messages[1].content[0]"),
    ([], "messages[1].content"),
    (None, "messages[1].content"),  # a user's: required
])
def test_content_the_server_refuses_is_refused_naming_it(llm, content, param):
    with pytest.raises(InvalidParameter) as e:
        llm.chat([HELLO[0], {"role": "user", "content": content}], GREEDY, use_tqdm=False)
    assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("role", ["wizard", 5, None])
def test_a_role_the_server_refuses_is_refused_naming_it(llm, role):
    """A template renders the roles it knows and may drop any other unseen (Qwen3's does), so the server's roles
    only, as the server takes them."""
    users_only = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(InvalidParameter, match=r"^'messages\[1\].role' must be one of system, developer, user, "
                                               "assistant, tool$") as e:
        llm.chat([HELLO[1], {"role": role, "content": "Answer in French."}], GREEDY, use_tqdm=False,
                 chat_template=users_only)
    assert e.value.param == "messages[1].role"
    assert_all_free(llm)


@pytest.mark.parametrize("argument, value, must", [
    ("add_generation_prompt", "no", "a bool"),  # a string would count as true: the header it asks to leave out
    ("continue_final_message", "yes", "a bool"),
    ("chat_template_kwargs", [("enable_thinking", False)], "a dict of the variables the template reads"),
    ("chat_template", 5, "a Jinja template, or the path of a file holding one"),
])
def test_chat_arguments_of_another_type_are_refused_naming_them(llm, argument, value, must):
    with pytest.raises(TypeError, match="^" + re.escape(f"{argument} must be {must}, got {value!r}") + "$"):
        llm.chat(HELLO, GREEDY, use_tqdm=False, **{argument: value})
    assert_all_free(llm)


def test_a_template_file_may_be_given_as_a_path(llm, tmp_path):
    template = tmp_path / "user_only.jinja"
    template.write_text("{% for m in messages %}{% if m.role == 'user' %}<<{{ m.content }}>>{% endif %}{% endfor %}")
    (out,) = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=template)
    assert out.prompt_token_ids == llm.tokenizer.encode("<<Hello there>>")


THINKING = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if enable_thinking is not defined or enable_thinking %}<think>{% endif %}")


@pytest.mark.parametrize("constrained, kwargs, thinks", [
    (False, None, True),
    (True, None, False),  # a constrained reply starts as its grammar wants, not with <think>
    (True, {"enable_thinking": True}, True),  # unless the caller asks for it
])
def test_a_constrained_chat_renders_without_thinking_as_the_servers_does(llm, constrained, kwargs, thinks):
    params = SamplingParams(max_tokens=2, temperature=0,
                            structured_outputs=StructuredOutputsParams(regex="a+") if constrained else None)
    (out,) = llm.chat(HELLO, params, use_tqdm=False, chat_template=THINKING, chat_template_kwargs=kwargs)
    assert ("<think>" in llm.tokenizer.decode(out.prompt_token_ids)) == thinks
    body = {"messages": HELLO, "max_tokens": 2, "temperature": 0, **({"guided_regex": "a+"} if constrained else {}),
            **({"chat_template_kwargs": kwargs} if kwargs else {})}
    info = ModelInfo("m", llm.tokenizer, 512, ChatTemplate(THINKING))
    assert out.prompt_token_ids == parse_chat(body, info).prompts[0]
    assert_all_free(llm)
