"""A Llama-2-style checkpoint (SentencePiece-style tokenizer: `▁`, byte fallback) serves: through the
server, the streamed text of each of 208 random generations is exactly what the ids the engine generated
add to its prompt's decoded text (cut at its stop string; its first space kept), with emoji, newlines and characters spelt in byte tokens
among them."""

from __future__ import annotations

import http.client
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving import serving

from minfer import LLM, EngineConfig, SamplingParams
from minfer.text.tokenizer import Tokenizer

NUM_REQUESTS = 208
PROMPTS = ["Hello", "Once upon a time", "日本語 🤖\n", "naïve café\n\n", "x = [1, 2]\n", "😀 🚀 🌍"]
STOPS = [None, ["\n"], ["e", "🤖"], ["😀", "🚀"], [" t"], ["a", "\n\n"]]
ENGINE = dict(num_kv_blocks=256, max_num_seqs=32)


def requests() -> list[dict]:
    rng = random.Random(0)
    return [
        {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 40), "temperature": 1.0, "seed": i,
         "stop": STOPS[i % len(STOPS)]}
        for i in range(NUM_REQUESTS)
    ]


def streamed_text(port: int, body: dict) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    pieces = []
    for line in response:
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
    conn.close()
    return "".join(pieces)


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    """The text before the stop string that starts first, as the engine cuts it."""
    found = [i for i in (text.find(s) for s in stop or []) if i >= 0]
    return text[: min(found)] if found else text


def continuation(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """decode() of ids, with the space it drops from the first token (`▁the`), as the start of a text, put
    back: a continuation of a prompt with any text keeps it."""
    text = tok.decode(ids)
    first = next((tok.id_to_token(i) for i in ids if i not in (1, 2)), "")
    has_text = any(i not in (1, 2) for i in prompt)
    return " " + text if first.startswith("▁") and has_text else text


def byte_runs(tok: Tokenizer, ids: list[int]) -> list[list[int]]:
    """The runs of consecutive byte-fallback tokens (<0xE6><0x97><0xA5>) in ids."""
    runs, run = [], []
    for i in ids + [-1]:
        if 0 <= i < tok.vocab_size and tok.id_to_token(i).startswith("<0x"):
            run.append(i)
        elif run:
            runs, run = runs + [run], []
    return runs


@pytest.fixture(scope="module")
def llama2(make_checkpoint):
    return make_checkpoint("llama2-tiny")


def test_llama2_streams_exactly_what_decode_gives(llama2):
    tok = Tokenizer.from_dir(llama2)
    bodies = requests()
    # The engine's own ids for each request: a seeded request samples the same tokens in any batch.
    params = [SamplingParams(max_tokens=b["max_tokens"], temperature=1.0, seed=b["seed"], stop=b["stop"]) for b in bodies]
    prompts = [tok.encode_prompt(b["prompt"]) for b in bodies]
    outputs = LLM(str(llama2), **ENGINE).generate(prompts, params, use_tqdm=False)
    with serving(EngineConfig(str(llama2), **ENGINE)) as srv:
        with ThreadPoolExecutor(32) as pool:  # as many clients as the engine runs sequences
            streamed = list(pool.map(lambda body: streamed_text(srv.server_address[1], body), bodies))
    for body, prompt, out, text in zip(bodies, prompts, outputs, streamed):
        whole = continuation(tok, prompt, out.token_ids)
        assert text == cut_at_stop(whole, body["stop"]) == out.text, (body, out.token_ids)

    # What the generations hold, so the equality above means something.
    finished = [o.finish_reason for o in outputs]
    assert finished.count("stop") >= 40 and finished.count("length") >= 40
    assert sum(o.text != continuation(tok, p, o.token_ids) for p, o in zip(prompts, outputs)) >= 20, "stop strings cut"
    assert any(o.text.startswith(" ") for o in outputs), "a continuation that begins with its space"
    everything = "".join(streamed)
    assert "\n" in everything and any(e in everything for e in "😀🚀🤖🌍")
    runs = [tok.decode(run) for o in outputs for run in byte_runs(tok, o.token_ids)]
    assert any(len(r.encode()) > 1 and "\ufffd" not in r for r in runs), "a character spelt in byte tokens"
    assert any("\ufffd" in r for r in runs), "a run of invalid bytes, which decode() shows as U+FFFD"


def test_a_stop_token_lets_out_the_bytes_held_before_it(llama2):
    """A run of byte tokens waits for the token that ends it; when that token is a stop token (EOS, or one
    of stop_token_ids, whose own text is not shown), the run still comes out, as decode() shows it."""
    tok = Tokenizer.from_dir(llama2)
    llm = LLM(str(llama2), num_kv_blocks=64)
    prompt = tok.encode_prompt("Hello")
    ids = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)[0].token_ids
    runs_end = [k for k in range(1, len(ids)) if byte_runs(tok, ids[k - 1 : k]) and not byte_runs(tok, ids[k : k + 1])]
    k = next(k for k in runs_end if ids[k] not in ids[:k])  # a token that ends a run, first seen there
    stopped = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[ids[k]])
    out = llm.generate([prompt], stopped, use_tqdm=False)[0]
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"
    assert out.text == tok.decode(ids[:k]) and out.text.endswith(tok.decode(byte_runs(tok, ids[:k])[-1]))
