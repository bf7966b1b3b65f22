"""Golden outputs: the server's SSE and JSON replies to fixed requests, recorded once and kept as fixtures.

`python tests/golden_outputs.py record DIR` writes tests/golden/*.json from the code at hand; the test
(test_golden_outputs.py) replays the same requests and compares, ids and timestamps masked. The requests
run on a random GPT-2 checkpoint this module writes (seeded: the same weights and tokenizer each time).
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"
MASKED = ("id", "created")  # differ on every request

REQUESTS = {
    "chat_stream": ("/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        "max_tokens": 12, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}),
    "chat": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}),
    "completion_stream_logprobs_n2": ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "seed": 7, "n": 2, "logprobs": 2,
        "stream": True}),
    "completion_logprobs_n2": ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.8, "seed": 7, "n": 2, "logprobs": 1,
        "stop": ["e"]}),
    "scoring_batch_echo": ("/v1/completions", {
        "prompt": ["The cat sat", "On the mat"], "max_tokens": 0, "echo": True, "logprobs": 1}),
    "scoring_batch_echo_generate": ("/v1/completions", {
        "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0,
        "prompt_logprobs": 1}),
    "error_temperature": ("/v1/completions", {"prompt": "x", "temperature": -1}),
    "error_context": ("/v1/completions", {"prompt": "x", "max_tokens": 100000}),
    "error_role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    "error_token_id": ("/v1/completions", {"prompt": [[1, 2], [99999]]}),
    "error_unsupported": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": {"x": 1}}),
}


def write_checkpoint(directory: Path) -> Path:
    from minfer.checkpoints import write_random_gpt2

    (directory / "golden-gpt2").mkdir(parents=True, exist_ok=True)
    return write_random_gpt2(directory / "golden-gpt2", "tiny", "hub", seed=0)


def mask(obj):
    if isinstance(obj, dict):
        return {k: ("<masked>" if k in MASKED else mask(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [mask(v) for v in obj]
    return obj


def ask(port: int, path: str, body: dict) -> dict:
    """{status, body} (JSON) or {status, events} (SSE, each event's JSON or "[DONE]"), masked."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    if response.getheader("Content-Type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
        return {"status": response.status, "events": [e if e == "[DONE]" else mask(json.loads(e)) for e in events]}
    return {"status": response.status, "body": mask(json.loads(raw))}


def replies(checkpoint: Path) -> dict[str, dict]:
    from minfer.engine.config import EngineConfig
    from minfer.server.serve import create_server

    server = create_server(EngineConfig(str(checkpoint), num_kv_blocks=64), port=0, served_model_name="golden",
                           log_requests=False)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        return {name: ask(server.server_address[1], path, body) for name, (path, body) in REQUESTS.items()}
    finally:
        server.stop(grace=1.0)


if __name__ == "__main__":
    if sys.argv[1:2] != ["record"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/golden_outputs.py record SCRATCH_DIR")
    GOLDEN.mkdir(exist_ok=True)
    for name, reply in replies(write_checkpoint(Path(sys.argv[2]))).items():
        (GOLDEN / f"{name}.json").write_text(json.dumps(reply, indent=1, sort_keys=True) + "\n")
        print(name, reply["status"])
