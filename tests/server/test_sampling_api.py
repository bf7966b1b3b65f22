"""The sampling fields and n > 1 through the HTTP API: each field reaches the engine (the server's text is
the offline engine's for the same SamplingParams), n choices come back with their index, streamed or not,
bad values are 400s naming the field, and no request leaves a block behind."""

import http.client
import json
import socket
import threading

import openai
import pytest
from serving import serving, texts_by_index, wait_all_free

from minfer import LLM, EngineConfig, SamplingParams
from minfer.server.serve import create_server

CHAT_MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(n_positions=1024)


@pytest.fixture(scope="module")
def server(checkpoint):
    with serving(EngineConfig(str(checkpoint), num_kv_blocks=300, max_num_seqs=8)) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), num_kv_blocks=300)


def post(server, path, body, timeout=60):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=timeout)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type", "").startswith("application/json"):
        return resp.status, json.loads(raw)
    return resp.status, [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
                         for line in raw.splitlines() if line.startswith("data: ")]


def test_n_choices_streamed_and_not_equal_the_engine(server, llm):
    tokenizer = llm.tokenizer
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 3, "n": 3}
    status, out = post(server, "/v1/completions", body)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    ref = llm.generate([tokenizer.encode_prompt("Once upon a time")],
                       SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3), use_tqdm=False)
    assert [c["text"] for c in out["choices"]] == [r.text for r in ref]
    assert out["usage"]["prompt_tokens"] == len(ref[0].prompt_token_ids)
    assert out["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in ref)
    status, events = post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["usage"] == out["usage"]
    texts, finishes = texts_by_index(events)
    assert texts == {i: r.text for i, r in enumerate(ref)}
    assert finishes == {i: r.finish_reason for i, r in enumerate(ref)}
    wait_all_free(server)


def test_chat_n_streams_a_role_per_choice(server):
    body = {"messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0.9, "seed": 1, "n": 2}
    status, out = post(server, "/v1/chat/completions", body)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    status, events = post(server, "/v1/chat/completions", {**body, "stream": True})
    roles = [c["index"] for e in events[:-1] for c in e["choices"] if c["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    texts, finishes = texts_by_index(events)
    assert texts == {c["index"]: c["message"]["content"] for c in out["choices"]} and len(finishes) == 2
    wait_all_free(server)


def test_openai_client_with_n_and_the_sampling_fields(server, llm):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0)
    fields = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "logit_bias": {"7": 4.0}, "seed": 9}
    vllm_fields = {"repetition_penalty": 1.4, "min_p": 0.05, "min_tokens": 4, "top_k": 40}
    out = client.completions.create(model=server.info.name, prompt="The dragon", max_tokens=10, n=2,
                                    temperature=0.8, extra_body=vllm_fields, **fields)
    params = SamplingParams(max_tokens=10, n=2, temperature=0.8, presence_penalty=0.8, frequency_penalty=0.6,
                            logit_bias={7: 4.0}, seed=9, repetition_penalty=1.4, min_p=0.05, min_tokens=4, top_k=40)
    ref = llm.generate([llm.tokenizer.encode_prompt("The dragon")], params, use_tqdm=False)
    assert [c.text for c in out.choices] == [r.text for r in ref]
    # Each field changes what comes out: none is accepted and dropped.
    plain = llm.generate([llm.tokenizer.encode_prompt("The dragon")],
                         SamplingParams(max_tokens=10, n=2, temperature=0.8, seed=9), use_tqdm=False)
    assert [r.token_ids for r in plain] != [r.token_ids for r in ref]
    wait_all_free(server)


def test_stop_token_ids_and_include_stop_str_reach_the_engine(server, llm):
    ids = llm.tokenizer.encode_prompt("Hello there")
    free = llm.generate([ids], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop_id = free.token_ids[2]
    status, out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 10, "temperature": 0,
                                                   "ignore_eos": True, "stop_token_ids": [stop_id]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == free.token_ids.index(stop_id) + 1
    stop = llm.tokenizer.decode(free.token_ids[1:3])
    if stop.strip():
        body = {"prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stop": [stop]}
        cut = post(server, "/v1/completions", body)[1]["choices"][0]["text"]
        kept = post(server, "/v1/completions", {**body, "include_stop_str_in_output": True})[1]["choices"][0]["text"]
        assert kept == cut + stop
    wait_all_free(server)


BAD = [  # (endpoint, extra fields, the field the 400 names)
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "high"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"repetition_penalty": -1.5}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.01}, "min_p"),
    ("/v1/completions", {"min_p": [0.1]}, "min_p"),
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"hello": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "up"}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"stop_token_ids": "7"}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [-7]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [100000]}, "stop_token_ids"),  # past the vocabulary: could never stop
    ("/v1/completions", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("/v1/completions", {"skip_special_tokens": 0}, "skip_special_tokens"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 2.5}, "n"),
    ("/v1/completions", {"n": 9}, "n"),  # more than max_num_seqs (8)
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"n": 2, "best_of": 4}, "best_of"),
    ("/v1/chat/completions", {"presence_penalty": -2.1}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"min_tokens": 5, "max_completion_tokens": 2}, "min_tokens"),
    ("/generate", {"n": 2}, "n"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),  # vLLM's, not implemented: refused
    ("/v1/chat/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
]


@pytest.mark.parametrize("path, extra, param", BAD, ids=[f"{p} {json.dumps(e)}" for p, e, _ in BAD])
def test_bad_sampling_fields_are_400s_naming_the_field(server, path, extra, param):
    body = {"messages": CHAT_MESSAGES} if "chat" in path else {"prompt": "Hi"}
    length = {"max_new_tokens": 8} if path == "/generate" else {"max_tokens": 8}  # /generate's own name
    length = {} if "max_completion_tokens" in extra else length  # two budgets that disagree are a 400 of their own
    status, out = post(server, path, {**length, **body, **extra})
    assert status == 400, out
    assert out["error"]["param"] == param and param in out["error"]["message"]
    status, ok = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 2})
    assert status == 200 and len(ok["choices"]) == 2  # still serving
    wait_all_free(server)


def test_client_that_leaves_an_n_stream_midway_frees_every_block(server):
    port = server.server_address[1]
    data = json.dumps({"prompt": "Once", "max_tokens": 400, "n": 6, "stream": True, "ignore_eos": True}).encode()
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
            received = b""
            while received.count(b"data: ") < 20:  # the six choices are under way
                received += s.recv(65536)
            assert server.manager.stats()["num_running"] >= 1
        wait_all_free(server)
    best_n = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "n": 2, "best_of": 2})
    assert best_n[0] == 200 and len(best_n[1]["choices"]) == 2


def test_a_server_too_small_for_eight_copies_serves_n8_without_preempting(checkpoint):
    """48 blocks of 16 tokens: eight copies of a 512-token prompt would need 256; shared, 32 + 8 x 1."""
    small = create_server(EngineConfig(str(checkpoint), num_kv_blocks=48, max_num_seqs=8), port=0)
    threading.Thread(target=small.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        prompt = [(7 * i) % 500 for i in range(512)]
        status, out = post(small, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "n": 8, "seed": 1,
                                                      "temperature": 1.0, "ignore_eos": True})
        assert status == 200 and len(out["choices"]) == 8
        assert out["usage"] == {"prompt_tokens": 512, "completion_tokens": 128, "total_tokens": 640,
                                "prompt_tokens_details": {"cached_tokens": 0}}  # shared blocks, none cached
        stats = small.manager.stats()
        assert stats["num_preemptions"] == 0
        wait_all_free(small)
    finally:
        small.stop(grace=1.0)


def test_batched_prompts_with_n_and_logprobs(server, llm):
    """Two prompts x n = 2: choice i * n + j is prompt i's completion j (vLLM's numbering), the same
    streamed and not, each with the logprobs of its own tokens; usage counts each prompt once."""
    prompts = ["Once upon", "The cat"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "seed": 3, "logprobs": 1, "echo": True, "ignore_eos": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    tok = llm.tokenizer
    for c in choices:
        prompt = prompts[c["index"] // 2]
        assert c["text"].startswith(prompt)  # echo: each choice carries its own prompt
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(tok.encode(prompt)) + 5
        assert lp["token_logprobs"][0] is None  # the prompt's first token has no context
    expected = [o.text for p in prompts for o in llm.generate([p], SamplingParams(max_tokens=5, n=2, seed=3,
                                                                                  ignore_eos=True), use_tqdm=False)]
    assert [c["text"][len(prompts[c["index"] // 2]):] for c in choices] == expected
    prompt_tokens = sum(len(tok.encode(p)) for p in prompts)
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 20,
                            "total_tokens": prompt_tokens + 20,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # no prompt fills a block: none cached

    status, events = post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    texts, finished = ["", "", "", ""], set()
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
            if c["finish_reason"] is not None:
                finished.add(c["index"])
    assert texts == [c["text"] for c in choices] and finished == {0, 1, 2, 3}
    assert events[-2]["usage"] == out["usage"]
    wait_all_free(server)
