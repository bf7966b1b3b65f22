"""Every request field of the serving contract at the extremes JSON allows, through a real server: each answer is
a 200 or a 4xx naming what is wrong, never a 5xx, and the requests running beside it are not failed. (A top_k
past int64 once failed its whole engine step, every request in it; a lone UTF-16 surrogate was a 500.)"""

import threading

import pytest
from serving import call, serving, wait_all_free

from minfer import EngineConfig
from minfer.server.request_fields import FIELDS

# Past int64, past fp32 either way (1e-300 is 0 in fp32, 1e300 inf), a lone surrogate, and both nested.
EXTREMES = [2**63, 10**30, 1e-300, 1e300, "\ud800", [10**30], {"1": 1e300}]
ENDPOINTS = {
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with serving(EngineConfig(str(tiny_checkpoint), num_kv_blocks=128, max_num_seqs=16)) as srv:
        yield srv


def test_no_field_at_an_extreme_is_a_5xx_or_fails_its_neighbours(server):
    port, answers, neighbours = server.server_address[1], [], []

    def neighbour():  # sampled like most traffic, long enough to share steps with the requests below
        body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "temperature": 1.0, "top_k": 40}
        neighbours.append(call(port, "POST", "/v1/completions", body, timeout=120)[0])

    def send(requests):
        for path, body in requests:
            answers.append((path, body, call(port, "POST", path, body, timeout=120)))

    requests = [(path, {**base, name: value}) for path, base in ENDPOINTS.items() for name in sorted(FIELDS)
                for value in EXTREMES if name not in ("prompt", "messages")]
    requests += [(path, {**base, "prompt" if "prompt" in base else "messages": value})
                 for path, base in ENDPOINTS.items() for value in EXTREMES]
    threads = [threading.Thread(target=neighbour) for _ in range(4)]
    threads += [threading.Thread(target=send, args=(requests[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == len(requests) > 800
    failed = [(path, body, status, out) for path, body, (status, _, out) in answers if status >= 500]
    assert failed == [], failed[:5]
    unnamed = [(body, out) for _, body, (status, _, out) in answers
               if 400 <= status < 500 and status != 404 and not out["error"]["message"]]
    assert unnamed == []
    assert neighbours == [200] * 4  # none failed with a bad request in its steps
    statuses = {status for _, _, (status, _, _) in answers}
    assert 200 in statuses and 400 in statuses  # both kinds of answer were had
    wait_all_free(server)


def test_an_n_the_engine_refuses_builds_nothing_per_choice_first(server, monkeypatch):
    """The response's per-choice state (a logprob formatter, a tool-call reader each) was built before the engine
    refused n: n = 10**9 with logprobs ran for many minutes and gigabytes before its 400. Here a formatter past
    max_num_seqs fails loudly (a 500) instead of slowly."""
    from minfer.server import logprobs_format

    built, real_init = [], logprobs_format.LogprobFormatter.__init__

    def counted_init(self, tokenizer):
        built.append(1)
        if len(built) > 16:
            raise MemoryError("a formatter per choice of an n the engine refuses")
        real_init(self, tokenizer)

    monkeypatch.setattr(logprobs_format.LogprobFormatter, "__init__", counted_init)
    port = server.server_address[1]
    for path, base in ENDPOINTS.items():
        logprobs = {"logprobs": 1} if "prompt" in base else {"logprobs": True, "top_logprobs": 1}
        status, _, out = call(port, "POST", path, {**base, **logprobs, "n": 10**9}, timeout=60)
        assert (status, out["error"]["param"]) == (400, "n"), out
    assert built == []


def test_stop_lists_are_bounded(server):
    """Every stop string is searched for after every token on the engine's one thread: a single request
    listing 50,000 (a 0.5 MB body) made each step some 60x slower, for every request on the server."""
    port = server.server_address[1]
    many = {"prompt": "Once", "max_tokens": 3, "stop": [f"zq{i}" for i in range(50_000)]}
    status, _, body = call(port, "POST", "/v1/completions", many)
    assert status == 400 and body["error"]["param"] == "stop" and "at most" in body["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stop": many["stop"]}
    assert call(port, "POST", "/v1/chat/completions", chat)[0] == 400
    status, _, body = call(port, "POST", "/v1/completions", {**many, "stop": many["stop"][:64]})
    assert status == 200, body
