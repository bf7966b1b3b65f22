"""Make docs/live_view.png and docs/live_view_8000.png: the live view of a busy minfer.serve, in
headless Chromium, with a small KV cache (64 blocks) and a real-sized one (8,000 blocks).

    python scripts/screenshot.py [--model DIR] [--num-kv-blocks N --out PATH]

Without --model it serves minfer-tiny, the small trained model minfer ships. Clients
stream requests that share a 64-token prefix (prefix-cache hits); in the small cache not all
of them fit (preemptions). The playground streams a story. The page is captured mid-run. With
--num-kv-blocks it makes one picture, of that cache, at --out.
Needs Chromium, chromium-driver and Selenium (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the headless-browser helper the tests use

from browser import Browser, missing  # noqa: E402

from minfer import EngineConfig  # noqa: E402
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


PICTURES = {64: ROOT / "docs" / "live_view.png", 8000: ROOT / "docs" / "live_view_8000.png"}


def capture(model: str, num_kv_blocks: int, out: str, seconds: float) -> None:
    srv = create_server(EngineConfig(model, num_kv_blocks=num_kv_blocks, max_num_seqs=12), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    stop = threading.Event()
    browser = Browser(width=1440, height=900)
    try:
        browser.set_viewport(1440, 900)
        browser.driver.get(f"http://127.0.0.1:{port}/")
        browser.wait_until(f"return blockMap.states.length === {num_kv_blocks}")
        for seed in range(16):
            threading.Thread(target=client, args=(port, seed, stop), daemon=True).start()
        browser.js(  # the playground's own request: a story, streamed into the page as it is written
            "document.getElementById('play-prompt').value = 'Once upon a time';"
            "document.getElementById('play-max').value = '120'; document.getElementById('play-send').click()"
        )
        time.sleep(seconds)
        browser.driver.save_screenshot(out)
        d = browser.js("return blockMap.drawn")
        print(
            f"wrote {out}; the block map was drawn whole {d['full']} times, {d['fullMs'] / max(1, d['full']):.1f} ms "
            f"each, and by changed cells {d['partial']} times, {d['partialMs'] / max(1, d['partial']):.2f} ms each "
            "(the overview bar included)"
        )
    finally:
        stop.set()
        browser.close()
        srv.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minfer-tiny", help="checkpoint directory or built-in name")
    parser.add_argument("--num-kv-blocks", type=int, help="one picture, of this many KV blocks (default: 64 and 8000)")
    parser.add_argument("--out", help="where that picture goes")
    parser.add_argument("--seconds", type=float, default=6.0, help="how long the load runs before the capture")
    args = parser.parse_args()
    if (args.num_kv_blocks is None) != (args.out is None):
        parser.error("--num-kv-blocks and --out go together")
    why = missing()
    if why:
        print(f"screenshot.py: {why}", file=sys.stderr)
        return 1
    model = args.model
    pictures = {args.num_kv_blocks: args.out} if args.out else PICTURES
    for num_kv_blocks, out in pictures.items():
        capture(model, num_kv_blocks, str(out), args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
