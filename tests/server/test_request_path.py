"""One request path: a body is parsed in one place, and the engine checks a request once, at the edge."""

import sys
import threading
from pathlib import Path

from serving import serving

from minfer import EngineConfig
from minfer.engine.scheduler import OnlineScheduler
from minfer.server import responder
from minfer.server.requests import ModelInfo, parse_completion
from minfer.text.tokenizer import Tokenizer

PACKAGE = Path(__file__).resolve().parents[2] / "minfer"


def files_run(fn) -> set[str]:
    """The minfer files whose functions run while fn() does (as scripts/core_path.py counts them)."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            seen.add(str(Path(frame.f_code.co_filename).relative_to(PACKAGE.parent)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_parsing_a_completion_runs_in_four_files(tiny_checkpoint):
    """The body, its sampling fields, its prompt's tokens, and errors.py's type checks: nothing else."""
    info = ModelInfo("m", Tokenizer.from_dir(tiny_checkpoint), 512)
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9,
            "stop": ["."], "logprobs": 2, "n": 2, "seed": 3, "logit_bias": {"5": 1.0}, "stream": True}
    files = files_run(lambda: parse_completion(body, info))
    assert files == {"minfer/server/requests.py", "minfer/engine/sampling_params.py", "minfer/text/tokenizer.py",
                     "minfer/errors.py"}


def test_the_engine_checks_a_server_request_once(tiny_checkpoint, monkeypatch):
    """A completion, a batch of two prompts, a chat: each prompt checked once, in the handler's thread, and
    never again on the engine's worker (add_request takes the CheckedRequest as it is)."""
    import http.client
    import json

    calls = []
    real = OnlineScheduler.check_request
    monkeypatch.setattr(
        OnlineScheduler, "check_request",
        lambda self, *a: calls.append(threading.current_thread().name) or real(self, *a),
    )
    with serving(EngineConfig(str(tiny_checkpoint), num_kv_blocks=32)) as srv:
        port = srv.server_address[1]
        for path, body, prompts in [
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}, 1),
            ("/v1/completions", {"prompt": ["Hi", "there"], "max_tokens": 3}, 2),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, 1),
        ]:
            calls.clear()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200, response.read()
            response.read()
            assert len(calls) == prompts and "minfer-engine" not in calls


def test_responder_is_the_only_response_builder():
    """No other module of the server builds a completion or chat body: each names the Responder."""
    server = PACKAGE / "server"
    builders = [p.name for p in server.glob("*.py") if '"text_completion"' in p.read_text() or
                '"chat.completion"' in p.read_text()]
    assert builders == ["responder.py"], builders
    assert not [n for n in dir(responder.Responder) if not n.startswith("_") and n not in
                ("response", "first_chunks", "delta_chunks", "usage_chunk", "usage")]
