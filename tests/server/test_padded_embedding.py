"""A model whose embedding has rows past its tokenizer's vocabulary (Qwen3: 151,936 rows, 151,669 tokens) may
sample those ids or rank them among its top logprobs: they add no text, as decode() skips them, and logprobs
show them as '' with no bytes. (Their bytes were looked up past the tokenizer's table: a 500 for the request.)"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from serving import API_KEY, call, serving, stream_events

from minfer import EngineConfig
from minfer.text.tokenizer import Tokenizer

ROWS, PADDED = 512, 640  # the tokenizer's ids, the embedding's rows
PAST = ROWS + 100  # an id the model embeds and the tokenizer does not have


@pytest.fixture(scope="module")
def padded(make_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("padded") / "model"
    shutil.copytree(make_checkpoint("qwen3-tiny"), d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"vocab_size": PADDED}))
    tensors = load_file(str(d / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]  # tied: the LM head too
    tensors["model.embed_tokens.weight"] = torch.cat([embedding, torch.zeros(PADDED - ROWS, embedding.shape[1])])
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_ids_past_the_tokenizer_show_no_text_in_completions_logprobs(padded):
    """Echoed and sampled, streamed or not: the padded id's token is '', at the offset the text has reached."""
    tok = Tokenizer.from_dir(padded)
    assert tok.vocab_size == ROWS
    hello = tok.encode("Hello")
    body = {"prompt": [*hello, PAST], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
            "logit_bias": {str(PAST): 100}}  # the model samples it
    with serving(EngineConfig(str(padded), num_kv_blocks=64), api_key=API_KEY) as srv:
        port = srv.server_address[1]
        status, _, whole = call(port, "POST", "/v1/completions", body)
        events = stream_events(port, "/v1/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["text"] == "Hello" and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tok.decode([i]) for i in hello] + [""] * 4
    assert logprobs["text_offset"][-4:] == [len("Hello")] * 4
    assert all(top is None or "" in top for top in logprobs["top_logprobs"][-3:])  # the sampled id, shown as ''
    streamed = [c for e in events[:-1] for c in e["choices"]]
    assert "".join(c["text"] for c in streamed) == "Hello"
    assert [o for c in streamed if c["logprobs"] for o in c["logprobs"]["text_offset"]] == logprobs["text_offset"]


def test_ids_past_the_tokenizer_show_no_bytes_in_chat_logprobs(padded):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "logit_bias": {str(PAST): 100}}
    with serving(EngineConfig(str(padded), num_kv_blocks=64), api_key=API_KEY) as srv:
        status, _, out = call(srv.server_address[1], "POST", "/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["message"]["content"] == ""
    entries = choice["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in entries] == [("", [])] * 2
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
