"""Make docs/live_view.png: the live view of a busy minfer.serve, in headless Chromium.

    python scripts/screenshot.py [--model DIR] [--out docs/live_view.png]

Without --model it writes a tiny random checkpoint to a temporary directory. Clients
stream requests that share a 64-token prefix (prefix-cache hits) into a KV cache too
small for all of them (preemptions), and the page is captured mid-run.
Needs Chromium, chromium-driver and Selenium (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the headless-browser helper the tests use

from browser import Browser, missing  # noqa: E402

from minfer import EngineConfig  # noqa: E402
from minfer.checkpoints import write_random_checkpoint  # noqa: E402
from minfer.server.serve import create_server  # noqa: E402


def client(port: int, seed: int, stop: threading.Event) -> None:
    rng = random.Random(seed)
    prefix = [(7 * i) % 500 for i in range(64)]  # the same for every client
    while not stop.is_set():
        prompt = prefix + [rng.randrange(500) for _ in range(rng.randrange(8, 160))]
        body = {"prompt": prompt, "max_tokens": rng.randrange(60, 240), "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body))
            conn.getresponse().read()
        except OSError:
            return  # the server is shutting down
        finally:
            conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random one)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "live_view.png"))
    parser.add_argument("--seconds", type=float, default=6.0, help="how long the load runs before the capture")
    args = parser.parse_args()
    why = missing()
    if why:
        print(f"screenshot.py: {why}", file=sys.stderr)
        return 1
    model = args.model or str(write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny"))
    srv = create_server(EngineConfig(model, num_kv_blocks=160, max_num_seqs=12), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    stop = threading.Event()
    browser = Browser(width=1440, height=900)
    try:
        browser.set_viewport(1440, 900)
        browser.driver.get(f"http://127.0.0.1:{port}/")
        browser.wait_until("return document.querySelectorAll('#blocks [data-block]').length > 0")
        for seed in range(16):
            threading.Thread(target=client, args=(port, seed, stop), daemon=True).start()
        time.sleep(args.seconds)
        browser.driver.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        stop.set()
        browser.close()
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
