"""bench.py --base-url against a server that fails some requests: each one is counted as failed, with its
reason, and the run still reports the rest; one that ends before its length is counted and said. The server
here is a stand-in that answers the k-th completion request in the k-th way below (--max-concurrency 1 keeps
them in order)."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minfer.bench import cli as bench
from minfer.models.loader import BUILTIN_MODELS
from minfer.text.tokenizer import Tokenizer

TEXT = 'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
LAST = 'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
USAGE = 'data: {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}}\n\n'
REPLIES = {  # (status, body), the body sent whole, then the connection closed
    "served": (200, TEXT * 3 + LAST + USAGE + "data: [DONE]\n\n"),
    "refused": (429, '{"error": {"message": "too many requests", "type": "rate_limit_error"}}'),
    "dropped": (200, TEXT * 2),  # the server went away mid-stream: no finish_reason, no [DONE]
    "garbled": (200, 'data: {"choices": ["a"]}\n\n' * 2 + "data: [DONE]\n\n"),  # choices that are no objects
    "wrong usage": (200, TEXT * 3 + LAST + 'data: {"choices": [], "usage": ["3"]}\n\n' + "data: [DONE]\n\n"),
}


def bench_flags(num_requests, output_len=3):
    """bench.py's flags for num_requests of output_len tokens each, one at a time, in order."""
    return ["--model", "m", "--tokenizer", "minfer-tiny", "--num-requests", str(num_requests), "--input-len", "8",
            "--output-len", str(output_len), "--max-concurrency", "1", "--warmup-runs", "0", "--disable-tqdm"]


@pytest.fixture
def stand_in_server():
    """start(replies) -> the URL of a server whose k-th completion gets the k-th of replies."""
    servers = []

    def start(replies):
        replies = iter(replies)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_error(404)

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                status, body = next(replies)
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body.encode())
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

        servers.append(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
        threading.Thread(target=servers[-1].serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{servers[-1].server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_every_failed_request_is_counted_with_its_reason(stand_in_server, tmp_path, capsys):
    argv = ["--base-url", stand_in_server(REPLIES.values()), *bench_flags(len(REPLIES)),
            "--json", str(tmp_path / "b.json")]
    assert bench.main(argv) == 0
    out, err = capsys.readouterr()
    report = json.loads((tmp_path / "b.json").read_text())
    records = report["requests"]
    assert len(records) == len(REPLIES) and [r["index"] for r in records] == list(range(len(REPLIES)))
    assert report["summary"]["completed"] == 1 and report["summary"]["failed"] == len(REPLIES) - 1
    assert records[0]["success"] and records[0]["output_len"] == 3
    errors = dict(zip(REPLIES, (r["error"] for r in records)))
    assert errors["served"] is None
    assert errors["refused"].startswith("OSError: HTTP 429: ")
    assert errors["dropped"] == "OSError: the stream ended before its finish_reason or [DONE] (2 text chunks read)"
    assert errors["garbled"].startswith("ValueError: a stream chunk is not an OpenAI completion chunk: ")
    assert errors["wrong usage"] == "ValueError: the stream's usage holds no completion_tokens count: ['3']"
    assert "Failed requests:                         4" in out
    assert f"bench.py: 4 of {len(REPLIES)} requests failed, the first with OSError: HTTP 429" in err
    assert "Traceback" not in err


def test_a_request_cut_short_is_counted_and_said(stand_in_server, tmp_path, capsys):
    """A server that stops a request before its output length (it does not honour ignore_eos, say) runs another
    workload than the header says: its figures count the tokens it did generate, and the run says how many fell
    short."""
    stop = 'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}\n\n'
    short_usage = USAGE.replace('"completion_tokens": 3', '"completion_tokens": 2')
    cut = (200, TEXT * 2 + stop + short_usage + "data: [DONE]\n\n")
    url = stand_in_server([REPLIES["served"], cut, REPLIES["served"]])
    assert bench.main(["--base-url", url, *bench_flags(3), "--json", str(tmp_path / "b.json")]) == 0
    out, err = capsys.readouterr()
    report = json.loads((tmp_path / "b.json").read_text())
    assert [r["output_len"] for r in report["requests"]] == [3, 2, 3]
    summary = report["summary"]
    assert summary["completed"] == 3 and summary["failed"] == 0 and summary["cut_short"] == 1
    assert summary["total_output_tokens"] == 8
    assert "Requests cut short:                      1" in out
    assert "bench.py: 1 of 3 requests generated fewer tokens than asked, the first 2 of 3" in err



def test_without_usage_the_output_is_counted_in_tokens_not_chunks(stand_in_server, tmp_path, capsys):
    """A server that sends no usage: the output tokens are the streamed text's, tokenized (vLLM's count), not the
    chunks, which hold several tokens each where the server speculates or batches its stream."""
    pieces = ["Once upon a time,", " there was a dog."]
    chunks = "".join(TEXT.replace('"text": "a"', f'"text": "{p}"') for p in pieces)
    num_tokens = len(Tokenizer.from_dir(BUILTIN_MODELS["minfer-tiny"]).encode("".join(pieces)))
    assert num_tokens > len(pieces)
    url = stand_in_server([(200, chunks + LAST + "data: [DONE]\n\n")])
    assert bench.main(["--base-url", url, *bench_flags(1, num_tokens), "--json", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "b.json").read_text())["summary"]
    assert summary["total_output_tokens"] == num_tokens and summary["cut_short"] == 0
