"""The soak's scoring client: the requests an eval harness sends, mixed into the load.

In turn: lm-evaluation-harness's loglikelihood request (a batch of token-id prompts, echo, logprobs 1,
max_tokens 1, greedy); a prompt scored without generating (echo, max_tokens 0); and a stream with
logprobs. Each reply must be whole: one choice per prompt, one logprob per token (the prompt's first
null), usage summed, a greedy token's logprob the largest of its top ones, and a stream's chunks
carrying every token's logprob. A 429 (the queue is full) is counted, not a failure: it loses nothing.
"""

from __future__ import annotations

import json
import random
import time

from .clients import Tally, Target, check_error_reply


def _post(target: Target, body: dict) -> tuple[int, bytes]:
    conn = target.connection()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _prompt(rng: random.Random, target: Target) -> list[int]:
    return [rng.randrange(256) for _ in range(rng.randint(2, target.max_prompt_tokens))]  # byte tokens


def check_scored(tally: Tally, body: dict, reply: dict) -> None:
    """An echo reply: a choice per prompt with the prompt's logprobs (and any drawn token's) in full."""
    prompts, drawn = body["prompt"], body["max_tokens"]
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(len(prompts))):
        tally.fail(f"scoring: choices {[c['index'] for c in choices]} for {len(prompts)} prompts")
        return
    for prompt, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        values = lp["token_logprobs"]
        if len(values) != len(prompt) + drawn or values[0] is not None or None in values[1:]:
            tally.fail(f"scoring: {len(values)} logprobs for {len(prompt)} prompt + {drawn} drawn tokens")
            return
        if drawn and values[-1] != max(lp["top_logprobs"][-1].values()):
            tally.fail("scoring: the greedy token's logprob is not its largest top logprob")
    want_prompt = sum(map(len, prompts))
    usage = reply["usage"]
    if (usage["prompt_tokens"], usage["completion_tokens"]) != (want_prompt, drawn * len(prompts)):
        tally.fail(f"scoring: usage {usage} for {len(prompts)} prompts of {want_prompt} tokens")


def score_request(target: Target, tally: Tally, body: dict) -> None:
    status, payload = _post(target, body)
    if status == 429:
        tally.count("scoring requests refused with 429")
        return
    if status != 200:
        check_error_reply(tally, "scoring", status, payload)
        tally.fail(f"scoring: got {status}: {payload[:200]!r}")
        return
    check_scored(tally, body, json.loads(payload))
    tally.count("scoring requests answered")
    tally.count("prompts scored", len(body["prompt"]))


def logprob_stream(target: Target, tally: Tally, body: dict) -> None:
    conn = target.connection()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            check_error_reply(tally, "logprob stream", resp.status, resp.read())
            tally.count(f"logprob streams refused with {resp.status}")
            return
        events = [line[6:].strip() for line in resp.read().splitlines() if line.startswith(b"data: ")]
    finally:
        conn.close()
    if not events or events[-1] != b"[DONE]":
        tally.fail(f"logprob stream ended without [DONE]: {events[-2:]}")
        return
    chunks = [json.loads(e) for e in events[:-1]]
    carried = sum(len(c["choices"][0]["logprobs"]["token_logprobs"]) for c in chunks if c["choices"][0]["logprobs"])
    if carried != body["max_tokens"]:
        tally.fail(f"logprob stream carried {carried} logprobs for {body['max_tokens']} tokens")
        return
    tally.count("logprob streams finished")


def scorer(target: Target, tally: Tally, end: float, seed: int) -> None:
    rng = random.Random(seed)
    kind = seed % 3
    while time.monotonic() < end:
        try:
            _send(target, tally, rng, kind)
        except OSError as e:
            tally.fail(f"scorer: {type(e).__name__}: {e}")
            time.sleep(0.2)  # no hot loop against a server that is gone
        kind = (kind + 1) % 3


def _send(target: Target, tally: Tally, rng: random.Random, kind: int) -> None:
    if kind == 0:  # lm-eval's loglikelihood request
        prompts = [_prompt(rng, target) for _ in range(rng.randint(1, 4))]
        body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
        score_request(target, tally, body)
    elif kind == 1:  # score only
        body = {"prompt": [_prompt(rng, target)], "echo": True, "logprobs": 0, "max_tokens": 0}
        score_request(target, tally, body)
    else:
        n = rng.randint(2, 24)
        body = {"prompt": _prompt(rng, target), "max_tokens": n, "ignore_eos": True, "logprobs": 2, "stream": True}
        logprob_stream(target, tally, body)
