"""Scoring over HTTP: completions logprobs, echo, max_tokens 0, prompt_logprobs and batched prompts; chat
logprobs; streaming and not; the shapes checked against the openai SDK's own types; the values against
transformers; bad inputs refused with a 4xx naming the field while the server keeps serving."""

import http.client
import json
import math
import threading

import openai
import pytest
import torch
from serving import serving

from minfer import EngineConfig
from minfer.server.serve import create_server
from minfer.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with serving(EngineConfig(str(tiny_checkpoint), num_kv_blocks=200, max_num_batched_tokens=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    host, port = server.server_address[:2]
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return transformers.GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


def post(server, path, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def ref_logprobs(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_scores_the_prompt_like_lm_eval(server, client, hf, tok):
    """lm-evaluation-harness's request: token-id prompts, echo, logprobs 1, max_tokens 1, greedy."""
    prompts = [[5, 9, 200, 31, 7, 77], [400, 3, 3, 18]]
    c = client.completions.create(
        model=server.info.name, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    assert [ch.index for ch in c.choices] == [0, 1]
    assert c.usage.prompt_tokens == 10 and c.usage.completion_tokens == 2
    for ids, choice in zip(prompts, c.choices):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = ref_logprobs(hf, ids)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
            assert abs(max(lp.top_logprobs[i].values()) - ref[i - 1].max().item()) < TOL
        greedy = int(ref[-1].argmax())  # greedy: the drawn token is the argmax, its logprob the top one
        assert lp.tokens[-1] == tok.token_bytes[greedy].decode("utf-8", "replace")
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
        assert choice.text == tok.decode(ids) + tok.decode([greedy])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_max_tokens_zero_with_echo_only_scores(server, client, hf):
    text = "one two three four"
    c = client.completions.create(model=server.info.name, prompt=text, echo=True, logprobs=3, max_tokens=0)
    choice = c.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and c.usage.completion_tokens == 0
    ids = server.info.tokenizer.encode_prompt(text)
    assert len(choice.logprobs.token_logprobs) == len(ids)
    ref = ref_logprobs(hf, ids)
    assert all(len(top) in (3, 4) for top in choice.logprobs.top_logprobs[1:])
    for i in range(1, len(ids)):
        assert abs(choice.logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL


def test_tokens_that_share_a_string_show_the_likeliest_logprob(server, client, hf, tok):
    """Tokens that end mid-character all read U+FFFD and share one top_logprobs key: it holds the likeliest of
    them, so a greedy token's logprob is the key's largest (lm-eval's is_greedy) and no value is understated."""
    ids = torch.randint(0, tok.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    c = client.completions.create(model=server.info.name, prompt=ids, echo=True, logprobs=5, max_tokens=0)
    ref, shared = ref_logprobs(hf, ids), 0
    for i, top in enumerate(c.choices[0].logprobs.top_logprobs[1:], start=1):
        top5 = ref[i - 1].topk(5).indices.tolist()
        likeliest: dict[str, float] = {}  # by string: the largest logprob of the top 5 and the prompt's token
        for t in top5 + [ids[i]]:
            text = tok.token_bytes[t].decode("utf-8", "replace")
            likeliest[text] = max(likeliest.get(text, -math.inf), ref[i - 1, t].item())
        shared += len({tok.token_bytes[t].decode("utf-8", "replace") for t in top5}) < 5
        assert top.keys() == likeliest.keys() and all(abs(top[s] - lp) < TOL for s, lp in likeliest.items())
    assert shared >= 5  # a vocabulary of 512 byte-level tokens: a third read U+FFFD alone


def test_completion_logprobs_streamed_equal_whole(server, client):
    kwargs = {"model": server.info.name, "prompt": [1, 2, 3, 4, 5], "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    tokens, values, text = [], [], ""
    for chunk in chunks:
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                values += ch.logprobs.token_logprobs
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs
    assert len(values) == 12


def test_chat_logprobs(server, client):
    kwargs = {
        "model": server.info.name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].logprobs is None
    c = client.chat.completions.create(logprobs=True, top_logprobs=3, **kwargs)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens == 6
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == item.logprob  # greedy
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    streamed = []
    for chunk in client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]


def test_prompt_logprobs_field_and_batched_strings(server, hf):
    status, body = post(
        server,
        "/v1/completions",
        {
            "prompt": ["a b c", "d e"],
            "max_tokens": 2,
            "temperature": 0,
            "prompt_logprobs": 2,
        },
    )
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    for text, choice in zip(["a b c", "d e"], body["choices"]):
        ids = server.info.tokenizer.encode_prompt(text)
        ref = ref_logprobs(hf, ids)
        assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
        for i in range(1, len(ids)):
            entry = choice["prompt_logprobs"][i]
            assert abs(entry[str(ids[i])]["logprob"] - ref[i - 1, ids[i]].item()) < TOL
            assert {int(t) for t, e in entry.items() if e["rank"] <= 2} == set(ref[i - 1].topk(2).indices.tolist())


def test_streamed_batch_and_echo(server, client):
    chunks = list(
        client.completions.create(
            model=server.info.name,
            prompt=["x y", "z"],
            echo=True,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    whole = client.completions.create(
        model=server.info.name, prompt=["x y", "z"], echo=True, max_tokens=3, temperature=0
    )
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert texts[0].startswith("x y") and texts[1].startswith("z")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 6


BAD = [
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "prompt_logprobs": 99}, "prompt_logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [], "max_tokens": 1}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": [[1, 2], [3, "x"]]}, "prompt[1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [[1], [99999]]}, "prompt[1]"),
    ({"prompt": [1] * 600, "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
]
BAD_CHAT = [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_completion_fields(server, body, param):
    status, out = post(server, "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == param, out
    assert param.split("[")[0] in out["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 1})[0] == 200  # still serving


@pytest.mark.parametrize("extra, param", BAD_CHAT)
def test_bad_chat_fields(server, extra, param):
    status, out = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], **extra})
    assert status == 400 and out["error"]["param"] == param, out


def test_nothing_leaks(server):
    stats = server.manager.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]


def get(server, path) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def test_tokenizer_endpoints(server, tok):
    status, out = post(server, "/tokenize", {"prompt": "Hello there", "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok.encode_prompt("Hello there") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == server.info.max_model_len
    assert out["token_strs"] == [tok.id_to_token(t) for t in out["tokens"]]
    status, chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and tok.decode(chat["tokens"]) == "user: hi\nassistant:"
    assert post(server, "/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": "Hello there"})
    status, info = get(server, "/tokenizer_info")
    assert status == 200 and info["eos_token"] == "<|endoftext|>" and info["model_max_length"] > 0
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})[1]["tokens"]
    assert eos == [tok.eos_token_id]  # how lm-eval's remote tokenizer finds the EOS id
    asks_nothing = {"prompt": "Hello there", "continue_final_message": False, "mm_processor_kwargs": None}
    assert post(server, "/tokenize", asks_nothing)[1]["tokens"] == out["tokens"]
    assert post(server, "/tokenize", {"prompt": "a", "model": "another"})[0] == 404


def test_lm_eval_detects_the_remote_tokenizer(server):
    utils = pytest.importorskip("lm_eval.utils")
    host, port = server.server_address[:2]
    assert utils.check_remote_tokenizer_support(f"http://{host}:{port}/v1/completions")


BAD_TOKENIZER = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),  # a chat's field
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, "continue_final_message"),  # not applied: refused
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tools"),  # this template cannot render tools
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD_TOKENIZER)
def test_bad_tokenizer_requests(server, path, body, param):
    status, out = post(server, path, body)
    assert status == 400 and out["error"]["param"] == param, out
    assert get(server, "/tokenizer_info")[0] == 200  # still serving


def test_a_batch_beyond_the_queue_is_refused_whole(tiny_checkpoint):
    """Each prompt of a batch is an engine request and counts against --max-num-seqs + --max-queued: a batch
    larger than both could never be taken, and gets a 400 saying so (a 429 "retry later" was retried in vain)."""
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64, max_num_seqs=2), port=0, max_queued=1)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        status, out = post(srv, "/v1/completions", {"prompt": [[1, 2]] * 4, "max_tokens": 2})
        assert status == 400 and out["error"]["param"] == "prompt" and "4 prompts" in out["error"]["message"]
        status, out = post(srv, "/v1/completions", {"prompt": [[1, 2]] * 3, "max_tokens": 2})
        assert status == 200 and len(out["choices"]) == 3 and out["usage"]["completion_tokens"] == 6
        assert srv.manager.wait_released(5)
        stats = srv.manager.stats()
        assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    finally:
        srv.stop(grace=1.0)
