"""The live view in a real browser: headless Chromium opens the page while streams run.
Without Chromium it skips locally (saying how to install it) and fails in CI (CI=true)."""

import http.client
import json
import threading

import pytest
from browser import Browser, in_ci, missing

from minfer import EngineConfig
from minfer.server.serve import create_server

NUM_BLOCKS = 48
USED = "return document.querySelectorAll('#blocks [data-state=used]').length"


@pytest.fixture
def browser():
    why = missing()
    if why:
        (pytest.fail if in_ci() else pytest.skip)(f"live view browser test: {why}")
    b = Browser()
    yield b
    b.close()


def stream(port, max_tokens):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "a b c d e f g h", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    assert conn.getresponse().read().endswith(b"[DONE]\n\n")
    conn.close()


def test_page_shows_every_block_used_while_streams_run_and_none_after(browser, tiny_checkpoint):
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=NUM_BLOCKS, max_num_seqs=4), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        browser.driver.get(f"http://127.0.0.1:{port}/")
        browser.wait_until(f"return document.querySelectorAll('#blocks [data-block]').length === {NUM_BLOCKS}")
        ids = browser.js("return [...document.querySelectorAll('#blocks [data-block]')].map(e => +e.dataset.block)")
        assert sorted(ids) == list(range(NUM_BLOCKS))
        assert browser.js(USED) == 0
        # Remember the most blocks ever shown as used: the streams may end between two polls.
        browser.js(
            "window.maxUsed = 0; new MutationObserver(() => { window.maxUsed = Math.max(window.maxUsed, "
            "document.querySelectorAll('#blocks [data-state=used]').length); })"
            ".observe(document.getElementById('blocks'), {attributes: true, subtree: true});"
        )
        threads = [threading.Thread(target=stream, args=(port, 200)) for _ in range(4)]
        for t in threads:
            t.start()
        browser.wait_until("return window.maxUsed > 0", what="no block was ever shown as used")
        for t in threads:
            t.join()
        browser.wait_until(USED + " === 0", what="blocks still shown as used after every stream ended")
        states = browser.js("return [...document.querySelectorAll('#blocks [data-block]')].map(e => e.dataset.state)")
        assert set(states) <= {"free", "cached"} and "cached" in states  # full blocks stay in the prefix cache
        assert browser.wait_until("return document.querySelectorAll('#requests tbody tr').length === 0")

        # The playground streams through /v1 and learns its engine request id (to light up its blocks).
        browser.js("document.getElementById('play-max').value = 40; document.getElementById('play-temp').value = 0;")
        browser.driver.find_element("id", "play-send").click()
        browser.wait_until("return view.mine !== null && !document.getElementById('play-send').disabled")
        assert browser.js("return document.getElementById('play-out').textContent.length") > 0
        browser.wait_until(USED + " === 0")
        assert browser.js("return +document.getElementById('stat-step').textContent") > 0
        assert browser.console_errors() == []
    finally:
        srv.stop()


def test_page_asks_for_the_api_key_and_uses_it(browser, tiny_checkpoint):
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=NUM_BLOCKS), port=0, api_key="sesame")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        browser.driver.get(f"http://127.0.0.1:{srv.server_address[1]}/")
        browser.wait_until("return !document.getElementById('key-form').hidden", what="no API key prompt")
        assert browser.js("return document.querySelectorAll('#blocks [data-block]').length") == 0
        browser.driver.find_element("id", "key-input").send_keys("sesame\n")
        browser.wait_until(f"return document.querySelectorAll('#blocks [data-block]').length === {NUM_BLOCKS}")
        assert browser.js("return document.getElementById('status').dataset.status") == "live"
    finally:
        srv.stop()
