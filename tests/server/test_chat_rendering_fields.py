"""What a chat request asks of its prompt's rendering is applied, or refused with a 400 naming the field: never
accepted and dropped. add_generation_prompt and continue_final_message end the prompt as transformers'
apply_chat_template does with the same flags (and /tokenize counts that prompt); chat_template_kwargs must name
what the template reads, and a model without a template reads none."""

import pytest

from minfer.server.api_errors import APIError
from minfer.server.chat_requests import parse_chat
from minfer.server.requests import ModelInfo
from minfer.server.tokenizer_api import tokenize
from minfer.text.chat_template import ChatTemplate
from minfer.text.tokenizer import Tokenizer

HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
FLAGS = [  # (the request's fields, apply_chat_template's keyword arguments for the same prompt)
    ({}, {"add_generation_prompt": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({"continue_final_message": True}, {"continue_final_message": True}),  # then no generation prompt: vLLM's 400
    ({"continue_final_message": True, "add_generation_prompt": False}, {"continue_final_message": True}),
]
HF_TOKENIZERS = {}


def info_of(path) -> ModelInfo:
    tok = Tokenizer.from_dir(path)
    return ModelInfo("m", tok, 512, ChatTemplate.from_dir(path, tok))


@pytest.mark.parametrize("fields, hf", FLAGS, ids=["default", "no-generation-prompt", "continue", "continue-false"])
@pytest.mark.parametrize("reply", ["Hel", "Hello, wor  "])  # trailing spaces: Llama 3's template trims them
@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny", "llama2-tiny"])
def test_the_prompt_ends_as_transformers_renders_it(make_checkpoint, preset, reply, fields, hf):
    """Both fields were refused whatever their value (a 400 for any but the default): a client could not prefill
    the reply (continue_final_message) or render a conversation without the assistant's header."""
    transformers = pytest.importorskip("transformers")
    path = make_checkpoint(preset)
    if path not in HF_TOKENIZERS:
        HF_TOKENIZERS[path] = transformers.AutoTokenizer.from_pretrained(path)
    info, messages = info_of(path), [*HISTORY, {"role": "assistant", "content": reply}]
    want = HF_TOKENIZERS[path].apply_chat_template(messages, tokenize=False, **hf)
    flags = {k: v for k, v in hf.items() if k != "add_generation_prompt"}
    text = info.chat_template.render(messages, hf.get("add_generation_prompt", False), **flags)
    assert text == want
    if "continue_final_message" in hf:
        assert text.endswith((reply, reply.rstrip()))  # nothing after the reply's text: no end of its turn
    ids = parse_chat({"messages": messages, **fields}, info).prompt_token_ids
    assert ids == info.tokenizer.encode(want)
    assert tokenize({"messages": messages, **fields}, info)["tokens"] == ids  # /tokenize counts the same prompt


@pytest.mark.parametrize("fields, ending", [
    ({}, "assistant: Hel\nassistant:"),
    ({"add_generation_prompt": False}, "assistant: Hel\n"),
    ({"continue_final_message": True}, "assistant: Hel"),
])
def test_the_plain_rendering_ends_as_asked(tiny_checkpoint, fields, ending):
    """A model without a template (GPT-2): add_generation_prompt false had been ignored on /tokenize."""
    info, messages = info_of(tiny_checkpoint), [*HISTORY, {"role": "assistant", "content": "Hel"}]
    want = info.tokenizer.encode("system: Be brief.\nuser: Hi!\n" + ending)
    assert parse_chat({"messages": messages, **fields}, info).prompt_token_ids == want
    assert tokenize({"messages": messages, **fields}, info)["tokens"] == want


DROPS_REPLIES = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }};{% endif %}{% endfor %}"


@pytest.mark.parametrize("fields, template, param, words", [
    ({"continue_final_message": True, "add_generation_prompt": True}, None, "continue_final_message", "both true"),
    ({"continue_final_message": "yes"}, None, "continue_final_message", "boolean"),
    ({"add_generation_prompt": 0}, None, "add_generation_prompt", "boolean"),
    ({"continue_final_message": True}, DROPS_REPLIES, "continue_final_message", "does not write"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, None, "chat_template_kwargs.enable_thinking",
     "no chat template"),
    ({"chat_template_kwargs": {"greting": "hey"}}, "{{ greeting }}", "chat_template_kwargs.greting", "never reads"),
])
def test_what_cannot_apply_is_a_400_naming_it(tiny_checkpoint, fields, template, param, words):
    info = info_of(tiny_checkpoint)
    if template is not None:
        info.chat_template = ChatTemplate(template)
    messages = [*HISTORY, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(APIError) as e:
        parse_chat({"messages": messages, **fields}, info)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.message


def test_chat_template_kwargs_apply_where_the_template_reads_them(tiny_checkpoint):
    """A template reads the name: it applies. A model without a template takes none but `{}`, and a constraint
    asks no enable_thinking of a template that never reads it."""
    info = info_of(tiny_checkpoint)
    assert parse_chat({"messages": HISTORY, "chat_template_kwargs": {}}, info).prompt_token_ids == \
        parse_chat({"messages": HISTORY}, info).prompt_token_ids
    assert parse_chat({"messages": HISTORY, "guided_regex": "a"}, info).prompt_token_ids == \
        info.tokenizer.encode("system: Be brief.\nuser: Hi!\nassistant:")
    info.chat_template = ChatTemplate("{{ greeting }}:{{ messages | length }}")
    ids = parse_chat({"messages": HISTORY, "chat_template_kwargs": {"greeting": "hey"}}, info).prompt_token_ids
    assert info.tokenizer.decode(ids) == "hey:2"
