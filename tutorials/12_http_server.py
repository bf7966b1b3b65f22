"""Stage 12: the streaming HTTP server and the OpenAI API.

Starts minfer's server in this process (minfer.serve.create_server on port 0,
serve_forever in a thread), then talks to it the ways clients do: plain JSON
with urllib, a Server-Sent Events stream read line by line with http.client,
and the official `openai` SDK if it is installed. It checks that a streamed
greedy completion adds up to exactly the non-streamed one with the same token counts
(its prompt, asked again, served by the prefix cache),
shows the error body of bad requests, disconnects in the middle of a stream
and watches /metrics until the request's KV blocks are free, reads the engine
event feed (GET /engine/events) to find a prefix hit and a preemption, then
shuts the server down.

    python tutorials/12_http_server.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from _common import model_path, section

from minfer import EngineConfig
from minfer.models.config import GPT2Config
from minfer.server.serve import create_server
from minfer.text.tokenizer import Tokenizer


class LogLines(logging.Handler):
    """Keeps the server's log lines (one per request, logger "minfer.serve") to print at the end:
    handler threads log while we print, and two threads writing to stdout would interleave."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


server_log = LogLines()
logging.getLogger("minfer.serve").addHandler(server_log)
logging.getLogger("minfer.serve").setLevel(logging.INFO)
path = model_path()
tokenizer = Tokenizer.from_dir(path)
NAME = "tutorial-model"  # what clients put in "model"

section("start the server in-process on a free port")
CONTEXT = GPT2Config.from_json(Path(path) / "config.json").n_positions
# 64 blocks of 16 tokens, or fewer on a short context: 8 running requests must be able to outgrow it.
KV_BLOCKS = min(64, 4 * CONTEXT // 16)
server = create_server(EngineConfig(path, num_kv_blocks=KV_BLOCKS, max_num_seqs=8), port=0, served_model_name=NAME)
http_thread = threading.Thread(target=server.serve_forever, name="minfer-http", daemon=True)
http_thread.start()
host, port = server.server_address[:2]
base = f"http://{host}:{port}"
print(f"listening on {base}")


def call(method: str, route: str, body: dict | bytes | None = None) -> tuple[int, dict | str]:
    """One request with urllib; returns (status, parsed JSON or text), error statuses included."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(base + route, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw, kind = resp.status, resp.read(), resp.headers.get_content_type()
    except urllib.error.HTTPError as e:  # 4xx/5xx: the body says why
        status, raw, kind = e.code, e.read(), e.headers.get_content_type()
    return status, json.loads(raw) if kind == "application/json" else raw.decode()


def metrics() -> dict[str, float]:
    """GET /metrics (Prometheus text format) -> {name: value} for the plain samples."""
    _, text = call("GET", "/metrics")
    lines = (line.split() for line in text.splitlines() if line and not line.startswith("#"))
    return {parts[0]: float(parts[1]) for parts in lines if "{" not in parts[0]}


status, health = call("GET", "/health")
status_models, models = call("GET", "/v1/models")
print(f"GET /health -> {status} {health}")
print(f"GET /v1/models -> {status_models} {[m['id'] for m in models['data']]}")
assert status == status_models == 200 and models["data"][0]["id"] == NAME
assert health["engine"]["num_kv_blocks"] == KV_BLOCKS and health["engine"]["max_num_seqs"] == 8

section("POST /v1/completions, not streamed")
prompt = "The three most important things in life are"
request = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
status, whole = call("POST", "/v1/completions", request)
print(f"{status}: text {whole['choices'][0]['text']!r}, finish_reason {whole['choices'][0]['finish_reason']!r}")
print(f"usage {whole['usage']}")
assert status == 200
# The server tokenizes the prompt once, as we do here; usage counts exactly those tokens, and says how many
# of them the prefix cache served (none: this is the server's first completion).
n_prompt = len(tokenizer.encode(prompt))
assert whole["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 12, "total_tokens": n_prompt + 12,
                          "prompt_tokens_details": {"cached_tokens": 0}}

section("the same request streamed: Server-Sent Events over chunked HTTP")
conn = http.client.HTTPConnection(host, port, timeout=60)
body = dict(request, stream=True, stream_options={"include_usage": True})
conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
resp = conn.getresponse()
print(f"{resp.status} {resp.headers['Content-Type']}, Transfer-Encoding: {resp.headers['Transfer-Encoding']}")
pieces, finish, usage, raw_lines = [], None, None, []
while line := resp.readline():  # http.client undoes the chunking; SSE is "data: <json>\n\n"
    raw_lines.append(line)
    if not line.startswith(b"data: "):
        continue  # the blank line that ends each event
    data = line[len(b"data: ") :].strip()
    if data == b"[DONE]":
        break
    chunk = json.loads(data)
    for choice in chunk["choices"]:
        pieces.append(choice["text"])
        finish = choice["finish_reason"] or finish
    usage = chunk.get("usage") or usage  # the last chunk: no choices, just usage
conn.close()
print("first lines on the wire:")
for line in raw_lines[:4]:
    print(f"    {line!r:.110}")
print(f"{len(pieces)} text chunks: {pieces}")
print(f"last lines: {[line.strip()[:60] for line in raw_lines[-4:] if line.strip()]}")
assert "".join(pieces) == whole["choices"][0]["text"], "streamed text must equal the non-streamed text"
# Asked again, the prompt's full blocks come from the prefix cache (stage 9): its last token is always computed.
cached = (n_prompt - 1) // health["engine"]["block_size"] * health["engine"]["block_size"]
print(f"usage {usage}")
assert finish == whole["choices"][0]["finish_reason"] == "length"
assert usage == whole["usage"] | {"prompt_tokens_details": {"cached_tokens": cached}}

section("the OpenAI Python SDK")
try:
    from openai import OpenAI
except ImportError:
    print("the openai package is not installed (pip install -e \".[tutorials]\"); skipping this part")
else:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    sdk = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )  # a vLLM/minfer extension field
    print(f"completions.create -> {sdk.choices[0].text!r}")
    assert sdk.choices[0].text == whole["choices"][0]["text"] and sdk.usage.completion_tokens == 12
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    chat = dict(model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**chat)
    stream = client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    deltas, stream_usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
        stream_usage = chunk.usage or stream_usage
    print(f"chat, streamed in {len(deltas)} deltas -> {''.join(deltas)!r}; usage {stream_usage.model_dump()}")
    assert "".join(deltas) == full.choices[0].message.content
    assert stream_usage.total_tokens == full.usage.total_tokens and stream_usage.completion_tokens == 10

section("bad requests get a 4xx and an OpenAI-style error body")
for bad in [dict(request, max_tokens=-5), dict(request, model="gpt-9"), b"{not json"]:
    status, err = call("POST", "/v1/completions", bad)
    print(f"{status} {json.dumps(err)}")
    assert 400 <= status < 500 and set(err["error"]) == {"message", "type", "param", "code"}
# The rule that max_tokens is at least 1 is the engine's (SamplingParams); the server passes on its verdict,
# naming the field, instead of checking it a second time.
status, err = call("POST", "/v1/completions", dict(request, max_tokens=-5))
assert status == 400 and "max_tokens" in err["error"]["message"] and "-5" in err["error"]["message"]
assert {k: v for k, v in err["error"].items() if k != "message"} == {
    "type": "invalid_request_error",
    "param": "max_tokens",
    "code": "invalid_value",
}
status, _ = call("GET", "/health")
assert status == 200, "the server survives bad requests"

section("a client that disconnects mid-stream: the server frees what it held")
total = metrics()["minfer_kv_blocks_total"]
conn = http.client.HTTPConnection(host, port, timeout=60)
long = dict(request, max_tokens=min(300, server.info.max_model_len - n_prompt), stream=True)
conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
resp = conn.getresponse()
got = [resp.readline() for _ in range(4)]  # two events: it is generating
print(f"read {sum(line.startswith(b'data: ') for line in got)} events, then hang up")
conn.close()  # the socket goes away; the handler's next write fails and it releases the request
start = time.perf_counter()
while True:
    m = metrics()
    freed = m["minfer_kv_blocks_free"] == total and m["minfer_requests_running"] == 0
    if m["minfer_requests_aborted_total"] == 1 and freed:
        break
    assert time.perf_counter() - start < 60, f"the disconnected request was not freed: {m}"
    time.sleep(0.02)
print(
    f"soon after: aborted {m['minfer_requests_aborted_total']:.0f}, "
    f"kv blocks free {m['minfer_kv_blocks_free']:.0f}/{total:.0f}, "
    f"finished {m['minfer_requests_finished_total']:.0f}"
)

section("watching the engine: GET /engine/events, the feed the live view at / draws")
feed = http.client.HTTPConnection(host, port, timeout=60)
feed.request("GET", "/engine/events")
feed_resp = feed.getresponse()
events, raw = [], []


def read_feed() -> None:  # each SSE message is a JSON list of events; the first is a snapshot
    try:
        for line in feed_resp:
            raw.append(line)
            if line.startswith(b"data: "):
                events.extend(json.loads(line[6:]))
    except (OSError, http.client.HTTPException):
        pass  # the server shut down


def stream_ids(body: dict, n: int) -> list[str]:
    """Send n streams at once; the engine's id for each is in its X-Engine-Request-Id header."""
    ids = []

    def one() -> None:
        c = http.client.HTTPConnection(host, port, timeout=120)
        c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        ids.append(r.getheader("X-Engine-Request-Id"))
        r.read()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ids


def seen_finished(ids: list[str]) -> bool:
    done = {f[0] for e in events if e["type"] != "snapshot" for f in e["finished"]}
    return set(ids) <= done


threading.Thread(target=read_feed, daemon=True).start()
secret = "Gandalf " * 10  # a prompt of a few full blocks, which a second identical prompt reuses
first = stream_ids({"prompt": secret, "max_tokens": 4}, 1)
second = stream_ids({"prompt": secret, "max_tokens": 4}, 1)
# Together (at most 8 run at once) the crowd needs more than the cache's blocks, so the newest get preempted.
long = min(300, server.info.max_model_len // 2)  # tokens each crowd request generates
crowd = stream_ids(
    {"prompt": "One two three", "max_tokens": long, "ignore_eos": True}, min(8, KV_BLOCKS * 16 // long + 2)
)
assert None not in crowd, "every crowd request was accepted (its engine id came back)"
deadline = time.monotonic() + 120
while not seen_finished(first + second + crowd):
    assert time.monotonic() < deadline, "the feed never reported every request finished"
    time.sleep(0.02)
snapshot, steps = events[0], [e for e in events if e["type"] == "step"]
print(
    f"snapshot: {snapshot['num_blocks']} blocks ('{snapshot['blocks'][:24]}...': f free, u used, c cached); "
    f"then {len(steps)} steps"
)
joined = next(r for s in steps for r in s["running"] if r[0] == second[0])
first_chunk = next(c for s in steps for c in s["chunks"] if c[0] == second[0])
print(
    f"prefix hit: request {second[0]} joined with {joined[6]} of its {joined[1]} prompt tokens cached; "
    f"its first chunk starts at token {first_chunk[1]}"
)
full_blocks = (joined[1] - 1) // 16 * 16  # every full block but the one holding the last prompt token
assert joined[6] == first_chunk[1] == full_blocks > 0, (joined, first_chunk)
preempted = [(s["step"], rid) for s in steps for rid in s["preempted"]]
assert preempted, f"{KV_BLOCKS} blocks should not hold {len(crowd)} requests of {long}+ tokens"
step_no, victim = preempted[0]
back = next(s["step"] for s in steps if s["step"] > step_no and any(c[0] == victim for c in s["chunks"]))
print(
    f"preemption: at step {step_no} request {victim} left the running set and freed its blocks; "
    f"it ran again from step {back}, recomputing its tokens"
)
assert all(s["num_prefill_tokens"] + s["num_decode_tokens"] == sum(c[2] for c in s["chunks"]) for s in steps)
assert b"Gandalf" not in b"".join(raw), "the feed carries ids, lengths and block ids, never text"

section("shut down")
server.stop()  # fails in-flight requests with an error chunk, stops accepting, closes the socket
http_thread.join(timeout=10)
assert not http_thread.is_alive() and not server.manager.is_alive()
try:
    http.client.HTTPConnection(host, port, timeout=5).request("GET", "/health")
    raise AssertionError("the port should be closed")
except ConnectionRefusedError:
    print("the server thread has exited and the port is closed")
print("the server's log, one line per request (status, prompt+completion tokens, seconds):")
polls = [line for line in server_log.lines if '"GET /metrics"' in line]
for line in server_log.lines:
    if line not in polls:
        print(f"    {line}")
print(f"    (and {len(polls)} GET /metrics polls)")
assert any("client-gone" in line for line in server_log.lines), "the disconnect was noticed"
print(
    "\nOK: JSON and SSE agree token for token, usage is exact, errors are clean, disconnects free their "
    "blocks, the engine feed shows a prefix hit and a preemption without any text, shutdown is clean."
)
