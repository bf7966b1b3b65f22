"""Malformed requests the soak interleaves with its load: each must get a 4xx JSON error, never a 5xx or a
stack trace, and leave the server serving."""

from __future__ import annotations

import http.client
import json
import random
import time

from .clients import Tally, Target


def _post(body: bytes, path: bytes = b"/v1/completions", extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        path,
        extra,
        len(body),
        body,
    )


def _json(obj) -> bytes:
    return _post(json.dumps(obj).encode())


# (name, raw request bytes, the status it must get)
BAD_REQUESTS = [
    ("truncated JSON", _post(b'{"prompt": "Hi", "max_tokens":'), 400),
    ("not JSON at all", _post(b"\x00\xff\xfe garbage"), 400),
    ("invalid UTF-8 in a string", _post(b'{"prompt": "\xc3\x28"}'), 400),
    ("JSON array body", _json([1, 2, 3]), 400),
    ("NaN temperature", _post(b'{"prompt": "Hi", "temperature": NaN}'), 400),
    ("prompt a number", _json({"prompt": 7}), 400),
    ("token id out of vocabulary", _json({"prompt": [1, 10**9]}), 400),
    ("negative token id", _json({"prompt": [-1]}), 400),
    ("max_tokens a string", _json({"prompt": "Hi", "max_tokens": "9"}), 400),
    ("max_tokens beyond the context", _json({"prompt": "Hi", "max_tokens": 10**7}), 400),
    ("deeply nested JSON", _post(b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"), 400),
    ("logprobs 21", _json({"prompt": "Hi", "logprobs": 21}), 400),
    ("echo a string", _json({"prompt": "Hi", "echo": "yes"}), 400),
    ("an empty prompt list", _json({"prompt": []}), 400),
    ("a prompt list mixing text and ids", _json({"prompt": ["Hi", [1, 2]]}), 400),
    ("echo over the context", _json({"prompt": [1] * 5000, "echo": True, "logprobs": 1, "max_tokens": 0}), 400),
    (
        "chat top_logprobs without logprobs",
        _post(b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', b"/v1/chat/completions"),
        400,
    ),
    ("detokenize an id out of vocabulary", _post(b'{"tokens": [1, 1000000000]}', b"/detokenize"), 400),
    ("tokenize nothing", _post(b"{}", b"/tokenize"), 400),
    ("n = 0", _json({"prompt": "Hi", "n": 0}), 400),
    ("repetition_penalty = 0", _json({"prompt": "Hi", "repetition_penalty": 0}), 400),
    ("logit_bias of an unknown token", _json({"prompt": "Hi", "logit_bias": {"99999999": 5}}), 400),
    ("a regex that does not parse", _json({"prompt": "Hi", "guided_regex": "a(b"}), 400),
    ("an empty choice list", _json({"prompt": "Hi", "structured_outputs": {"choice": []}}), 400),
    ("a JSON schema with an unknown type", _json({"prompt": "Hi", "guided_json": {"type": "nope"}}), 400),
    (
        "response_format and structured_outputs both",
        _post(b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, '
              b'"structured_outputs": {"regex": "a"}}', b"/v1/chat/completions"),
        400,
    ),
    ("chat without messages", _post(b'{"max_tokens": 5}', b"/v1/chat/completions"), 400),
    ("chat message without role", _post(b'{"messages": [{"content": "x"}]}', b"/v1/chat/completions"), 400),
    ("unknown path", _json({"prompt": "Hi"}).replace(b"/v1/completions", b"/v2/nothing", 1), 404),
    ("GET on a POST endpoint", b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    ("no Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 411),
    ("chunked body", b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    ("Content-Length not a number", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    ("body over 1 MiB", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
    ("request line with one word too many", b"GET /health now HTTP/1.1\r\n\r\n", 400),
    ("not HTTP at all", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 a TLS hello\r\n\r\n", 400),
    ("a 70 KB request line", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    ("200 headers", b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n", 431),
]


def send_raw(target: Target, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes on a fresh connection: (status, body) of the reply."""
    with target.raw() as sock:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.read()


def malformer(target: Target, tally: Tally, end: float, seed: int, interval: float = 0.05) -> None:
    """Send the bad requests in a random order, over and over, between the soak's good traffic."""
    rng = random.Random(seed)
    while time.monotonic() < end:
        name, data, want = rng.choice(BAD_REQUESTS)
        try:
            status, payload = send_raw(target, data)
        except (OSError, http.client.HTTPException) as e:
            tally.fail(f"malformed {name!r}: {type(e).__name__}: {e}")
            time.sleep(0.2)
            continue
        if status != want:
            tally.fail(f"malformed {name!r}: got {status}, wanted {want}: {payload[:120]!r}")
        elif not json.loads(payload).get("error", {}).get("message"):
            tally.fail(f"malformed {name!r}: no error message in {payload[:120]!r}")
        if b"Traceback" in payload:
            tally.fail(f"malformed {name!r}: a stack trace in the reply")
        tally.count("malformed requests answered 4xx" if 400 <= status < 500 else "malformed requests, other")
        with tally.lock:
            tally.counts[f"bad input: {name}"] += 1
        time.sleep(interval)
