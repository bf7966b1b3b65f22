"""What watching costs the engine: time per engine step with 0 and with 3 /engine/events viewers.

    python scripts/feed_overhead.py [--model DIR] [--rounds 3]

The server runs in this process (to count its steps); the viewers are `curl`-like readers
in a child process, so their parsing does not compete with the engine for this process's
GIL. Each round runs the same workload (16 streams x 128 tokens, ignore_eos) once without
viewers and once with three, alternating, and prints ms per step (worker wall time / steps).
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from minfer import EngineConfig
from minfer.checkpoints import write_random_checkpoint
from minfer.server.serve import create_server

VIEWER = """
import http.client, sys, threading
def read():
    c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]))
    c.request("GET", "/engine/events")
    r = c.getresponse()
    while r.read(65536): pass
threads = [threading.Thread(target=read, daemon=True) for _ in range(3)]
[t.start() for t in threads]
print("ready", flush=True)
sys.stdin.read()
"""


def stream(port: int, k: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": [(k * 31 + i) % 500 for i in range(64)], "max_tokens": 128, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    conn.getresponse().read()
    conn.close()


def run_workload(srv, port: int) -> float:
    """ms per engine step for one pass of the workload."""
    steps0, t0 = srv.manager.scheduler.num_steps, time.perf_counter()
    threads = [threading.Thread(target=stream, args=(port, k)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1e3 / (srv.manager.scheduler.num_steps - steps0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random one)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory()  # the default checkpoint, removed at exit
    model = args.model or str(write_random_checkpoint(Path(scratch.name) / "tiny", "tiny"))
    srv = create_server(EngineConfig(model, max_num_seqs=16), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    run_workload(srv, port)  # warm-up
    results = {0: [], 3: []}
    try:
        for _ in range(args.rounds):
            results[0].append(run_workload(srv, port))
            viewers = subprocess.Popen(
                [sys.executable, "-c", VIEWER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            assert viewers.stdout.readline().strip() == "ready"
            while not srv.manager.events.active:
                time.sleep(0.01)
            results[3].append(run_workload(srv, port))
            viewers.stdin.close()
            viewers.wait()
    finally:
        srv.stop()
    for n, values in results.items():
        median = sorted(values)[len(values) // 2]
        print(f"{n} viewers: {' '.join(f'{v:.3f}' for v in values)} ms/step (median {median:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
