"""How much of minfer one default completion runs: the functions, their lines, the files they live in.

    python scripts/core_path.py [--model minfer-tiny] [--list]

Starts the server in-process with default settings, sends a warm-up request (not counted), then
puts a profiler on every thread (`threading.setprofile` and `sys.setprofile`) and sends one streamed
and one plain /v1/completions request. Every minfer function that ran is recorded. It prints:
(a) the lines of the files those functions live in, and (b) the lines of the functions themselves,
a nested function's lines counted once (the union of their line ranges, per file).
--list prints every file with its functions' lines; --order every function in the order it first
ran, with its thread (docs/life_of_a_request.md follows that order).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGE = ROOT / "minfer"


def function_lines(code) -> range:
    """The lines a code object spans, from its `def` to its last line."""
    last = max([code.co_firstlineno] + [line for _, _, line in code.co_lines() if line is not None])
    return range(code.co_firstlineno, last + 1)


class Recorder:
    """Collects the code objects of minfer functions called on any thread while it is on."""

    def __init__(self):
        self.codes: set = set()
        self.order: list[tuple[str, object]] = []  # (thread name, code) at each function's first call
        self.on = False

    def profile(self, frame, event, arg):
        if self.on and event == "call":
            code = frame.f_code
            if code.co_filename.startswith(str(PACKAGE)) and code not in self.codes:
                self.codes.add(code)
                self.order.append((threading.current_thread().name, code))

    def install(self):
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def report(self) -> tuple[int, int, dict[str, tuple[int, int]]]:
        lines_by_file: dict[str, set[int]] = defaultdict(set)
        for code in self.codes:
            if code.co_name == "<module>":
                continue
            lines_by_file[code.co_filename].update(function_lines(code))
        per_file = {}
        for name, lines in lines_by_file.items():
            total = len(Path(name).read_text(encoding="utf-8").splitlines())
            per_file[str(Path(name).relative_to(ROOT))] = (total, len(lines))
        files = sum(t for t, _ in per_file.values())
        functions = sum(f for _, f in per_file.values())
        return files, functions, per_file


def post(port: int, body: dict) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
    return data


def record(model: str = "minfer-tiny") -> Recorder:
    """Serve `model` in-process and record the minfer functions two completions run (a warm-up excluded)."""
    from minfer.server.serve import create_server

    recorder = Recorder()
    recorder.install()  # before the server's threads start: each new thread takes the profiler
    server = create_server(model, port=0, log_requests=False)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = server.server_address[1]
    try:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8}
        post(port, body)  # warm-up: not counted
        recorder.on = True
        post(port, body | {"stream": True})
        post(port, body)
        recorder.on = False
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
        server.stop(grace=1.0)
    return recorder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minfer-tiny")
    parser.add_argument("--list", action="store_true", help="print every file and its functions' lines")
    parser.add_argument("--order", action="store_true", help="print every function in the order it first ran")
    args = parser.parse_args()
    recorder = record(args.model)
    if args.order:
        for thread, code in recorder.order:
            where = f"{Path(code.co_filename).relative_to(ROOT)}:{code.co_firstlineno}"
            print(f"{thread[:24]:<24} {code.co_qualname:<48} {where}")
    files, functions, per_file = recorder.report()
    if args.list:
        for name, (total, used) in sorted(per_file.items(), key=lambda kv: -kv[1][1]):
            print(f"{used:5d} / {total:5d}  {name}")
    num_functions = sum(1 for c in recorder.codes if c.co_name != "<module>")
    print(f"functions run: {num_functions} in {len(per_file)} files")
    print(f"(a) lines of those files:     {files}")
    print(f"(b) lines of those functions: {functions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
