"""Chat models' tokenizers and templates: special tokens, EOS ids, rendering, and /v1/chat/completions."""

import http.client
import json
import threading

import pytest

from minfer import EngineConfig
from minfer.server.api_errors import APIError
from minfer.server.chat_requests import parse_chat
from minfer.server.requests import ModelInfo
from minfer.server.serve import create_server
from minfer.text.chat_template import ChatTemplate
from minfer.text.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, 世界!"}]


@pytest.fixture(scope="module")
def qwen(make_checkpoint):
    path = make_checkpoint("qwen3-tiny")
    tok = Tokenizer.from_dir(path)
    return path, tok, ChatTemplate.from_dir(path, tok)


def test_special_tokens_are_single_ids_and_decode_skips_them(qwen):
    _, tok, _ = qwen
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end and ids.count(im_end) == 1  # never split into bytes
    assert tok.decode(ids) == "user\nHi"
    stream = tok.detokenizer()
    assert "".join(stream.add(i) for i in ids) + stream.flush() == "user\nHi"  # the stream agrees
    # config.json names <|im_end|>; generation_config.json adds <|endoftext|>: a reply may end with either.
    assert tok.eos_token_ids == [im_end, tok.token_to_id("<|endoftext|>")] and tok.eos_token_id == im_end
    assert tok.encode_prompt("Hi") == tok.encode("Hi")  # Qwen3 adds no BOS
    # <think> is an added token but not a special one: one id, and kept in the text, streamed too.
    think = tok.encode("<think>ok</think>")
    assert think[0] == tok.token_to_id("<think>") and tok.decode(think) == "<think>ok</think>"
    stream = tok.detokenizer()
    assert "".join(stream.add(i) for i in think) == "<think>ok</think>"


def test_the_template_renders_chatml_and_stops_at_the_end_of_turn(qwen):
    _, tok, template = qwen
    text = template.render(MESSAGES)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi, 世界!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.stop_token_ids == [tok.token_to_id("<|im_end|>")]
    variables = ChatTemplate("{{ greeting }} {{ messages | length }}{{ add_generation_prompt }}")
    assert variables.render(MESSAGES, variables={"greeting": "hi"}) == "hi 2True"
    info = ModelInfo("q", tok, 512, template)
    parsed = parse_chat({"model": "q", "messages": MESSAGES, "max_tokens": 5}, info)
    assert parsed.prompt_token_ids == tok.encode(text)
    assert tok.token_to_id("<|im_end|>") in parsed.params.stop_token_ids
    with pytest.raises(APIError, match="unsupported role tool") as e:  # the template's raise_exception
        parse_chat({"model": "q", "messages": [{"role": "tool", "content": "x"}]}, info)
    assert e.value.status == 400 and e.value.param == "messages"


def test_llama3_template_uses_bos_and_eot(make_checkpoint):
    path = make_checkpoint("llama-tiny")
    tok = Tokenizer.from_dir(path)
    template = ChatTemplate.from_dir(path, tok)
    text = template.render(MESSAGES[1:])
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi, 世界!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert template.stop_token_ids == [tok.token_to_id("<|eot_id|>")]
    assert tok.token_to_id("<|eot_id|>") in tok.eos_token_ids
    # A plain prompt gets the BOS the tokenizer's post-processor adds; a rendered chat has its own.
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.encode_prompt("Hi") == [bos, *tok.encode("Hi")] and tok.encode(text).count(bos) == 1
    info = ModelInfo("l", tok, 512, template)
    assert parse_chat({"messages": MESSAGES[1:]}, info).prompt_token_ids == tok.encode(text)


def test_llama2_template_wraps_turns_in_inst(make_checkpoint):
    """Llama 2's style: the system message inside the first [INST], each reply ended by </s>; transformers
    renders the checkpoint's template the same."""
    transformers = pytest.importorskip("transformers")
    path = make_checkpoint("llama2-tiny")
    tok = Tokenizer.from_dir(path)
    template = ChatTemplate.from_dir(path, tok)
    messages = MESSAGES + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]
    text = template.render(messages)
    assert text == "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi, 世界! [/INST] Hello. </s><s>[INST] Again [/INST]"
    assert text == transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False)
    assert tok.encode(text).count(tok.token_to_id("<s>")) == 2 and tok.eos_token_ids == [tok.token_to_id("</s>")]


def test_templates_are_sandboxed_and_gpt2_keeps_plain_rendering(tiny_checkpoint):
    unsafe = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="could not render"):
        unsafe.render(MESSAGES)
    with pytest.raises(ValueError, match="the checkpoint's chat_template does not compile"):
        ChatTemplate("{% for %}")
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)  # a bad --chat-template is named as the flag, not the checkpoint
    with pytest.raises(ValueError, match=r"--chat-template '\{\{ x \}' does not compile"):
        ChatTemplate.from_dir(tiny_checkpoint, tokenizer, override="{{ x }")
    gpt2 = ChatTemplate.from_dir(tiny_checkpoint, tokenizer)
    assert gpt2.render(MESSAGES) == "system: Be brief.\nuser: Hi, 世界!\nassistant:" and not gpt2.stop_token_ids


def test_a_list_of_named_templates_renders_its_default_or_is_refused(qwen, tmp_path):
    """tokenizer_config.json may hold several named templates (Command R's default, tool_use, rag): the one
    named "default" renders. Without one, transformers refuses to render: minfer too, naming those there are,
    rather than fall back to the plain rendering the model never saw. --chat-template chooses instead."""
    import shutil

    path, tok, template = qwen
    listed = tmp_path / "listed"
    shutil.copytree(path, listed)
    config = json.loads((listed / "tokenizer_config.json").read_text())
    named = [{"name": "rag", "template": "{{ 'rag' }}"}, {"name": "default", "template": config["chat_template"]}]
    (listed / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert ChatTemplate.from_dir(listed, tok).render(MESSAGES) == template.render(MESSAGES)
    (listed / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named[:1]}))
    with pytest.raises(ValueError, match="chat templates named 'rag', but none named 'default'.*--chat-template"):
        ChatTemplate.from_dir(listed, tok)
    assert ChatTemplate.from_dir(listed, tok, override="{{ 'mine' }}").render(MESSAGES) == "mine"


def test_chat_over_http(qwen):
    path, tok, _ = qwen
    server = create_server(EngineConfig(str(path), num_kv_blocks=64, max_num_seqs=2), port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)

        def post(body):
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())

        status, reply = post({"model": str(path), "messages": MESSAGES, "max_tokens": 8, "temperature": 0})
        assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["prompt_tokens"] == len(tok.encode(ChatTemplate.from_dir(path, tok).render(MESSAGES)))
        status, reply = post({"model": str(path), "messages": [{"role": "tool", "content": "x"}]})
        assert status == 400 and reply["error"]["param"] == "messages"
    finally:
        server.stop(grace=1.0)


@pytest.mark.parametrize("preset, call, result", [
    ("qwen3-tiny", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
     "<tool_response>\n3\n</tool_response>"),
    ("llama-tiny", '{"name": "add", "parameters": {"a": 1}}', "<|start_header_id|>ipython<|end_header_id|>\n\n3"),
])
def test_the_writers_tool_templates_render_tools_calls_and_results(make_checkpoint, preset, call, result):
    """make_checkpoint(..., tools=True): a template that reads `tools`, writes an assistant's tool calls in its
    family's format and a tool's result its family's way; without tools it renders as the plain one."""
    path = make_checkpoint(preset, tools=True)
    tok = Tokenizer.from_dir(path)
    template, plain = ChatTemplate.from_dir(path, tok), ChatTemplate.from_dir(make_checkpoint(preset), tok)
    assert template.supports_tools and not plain.supports_tools
    assert template.render(MESSAGES) == plain.render(MESSAGES)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    text = template.render(history, tools=tools)
    assert '{"type": "function", "function": {"name": "add"' in text and call in text and result in text


# Jinja as transformers' apply_chat_template (and so vLLM) runs templates: with loop controls, its
# {% generation %} tag (for training masks), its tojson's options, and `documents` none.
HF_ONLY = {
    "loop controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }};"
                     "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}",
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{% set x = 1 %}"
                      "[{{ m.content }}]{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ x }}{% endfor %}",
    "tojson options": "{{ messages | tojson(separators=(',', ':')) }}{{ messages[1] | tojson(sort_keys=true) }}"
                      "{{ messages[1] | tojson(indent=2) }}",
    "documents": "{% if documents is not none %}{{ documents | length }}{% endif %}{{ documents is defined }}",
}


@pytest.mark.parametrize("name", HF_ONLY)
def test_templates_render_as_transformers_renders_them(name):
    """Each of these failed: a tag Jinja does not know without the extension, a keyword minfer's tojson did
    not take, or documents undefined where transformers has them none."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [*MESSAGES, {"role": "assistant", "content": "<b>Hello</b>"}, {"role": "user", "content": "Again"}]
    want = render_jinja_template([messages], chat_template=HF_ONLY[name], add_generation_prompt=True)[0][0]
    assert ChatTemplate(HF_ONLY[name]).render(messages) == want and want


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools"])
def test_chat_template_kwargs_cannot_stand_for_what_the_request_gives(qwen, name):
    """chat_template_kwargs naming what the render itself passes (the messages, add_generation_prompt, ...) is a
    400 naming it: the render's own value won, and the kwarg was accepted and silently not applied."""
    _, tok, template = qwen
    info = ModelInfo("q", tok, 512, template)
    with pytest.raises(APIError) as e:
        parse_chat({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False, name: False}}, info)
    assert (e.value.status, e.value.param) == (400, f"chat_template_kwargs.{name}") and name in e.value.message
