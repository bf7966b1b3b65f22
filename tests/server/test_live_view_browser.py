"""The live view in a real browser: headless Chromium opens the page while streams run, with a
small KV cache (64 blocks, all on the map) and a real-sized one (8,000 blocks: the map zooms to
the blocks in use). Without Chromium it skips locally (saying how to install it) and fails in CI
(CI=true)."""

import http.client
import json
import re
import threading
import time

import pytest
from browser import Browser, in_ci, missing

from minfer import EngineConfig
from minfer.server.serve import create_server

USED_RGB = [0x2F, 0x7D, 0xE1]  # --used in live.css
MINE_RGB = [0xD6, 0x33, 0x6C]  # --mine
SHARED_RGB = [0x17, 0x3F, 0x7A]  # --shared: a used block several sequences hold
LEGIBLE_PX = 6  # blockmap.js's LEGIBLE_CELL

# Draws the map as it stands and reports, in the same JS turn: its layout, and how many used
# blocks are off it or are not drawn in the used (or playground) colour. null while none is used.
CHECK_MAP = f"""
drawBlockMap();
const used = [];
blockMap.states.forEach((s, b) => {{ if (s === USED) used.push(b); }});
if (!used.length) return null;
const ctx = document.getElementById("blocks").getContext("2d"), ratio = window.devicePixelRatio || 1;
const colour = (b) => {{ const [x, y, size] = cellRect(b);
  return [...ctx.getImageData((x + size / 2) * ratio, (y + size / 2) * ratio, 1, 1).data.slice(0, 3)]; }};
const ok = (c) => [{USED_RGB}, {MINE_RGB}, {SHARED_RGB}].some((want) => want.every((v, i) => v === c[i]));
return {{used: used.length, cell: blockMap.layout.cell, first: blockMap.layout.first, count: blockMap.layout.count,
        offMap: used.filter((b) => cellRect(b) === null).length,
        wrongColour: used.filter((b) => cellRect(b) !== null && !ok(colour(b))).length,
        summary: describeMap()}};
"""


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


@pytest.mark.parametrize("num_blocks", [64, 8000])
def test_map_shows_the_blocks_in_use_legibly_while_streams_run_and_none_after(browser, tiny_checkpoint, num_blocks):
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=num_blocks, max_num_seqs=4), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        browser.driver.get(f"http://127.0.0.1:{port}/")
        browser.wait_until(f"return blockMap.states.length === {num_blocks} && blockMap.layout !== null")
        assert browser.js("return blockMap.counts") == [num_blocks, 0, 0]

        threads = [threading.Thread(target=stream, args=(port, 200)) for _ in range(4)]
        for t in threads:
            t.start()
        seen = browser.wait_until("return (() => {" + CHECK_MAP + "})()", what="no block was ever shown as used")
        assert seen["offMap"] == 0 and seen["wrongColour"] == 0, seen  # every used block is on the map, drawn
        assert seen["cell"] >= LEGIBLE_PX, seen
        if num_blocks == 64:
            assert (seen["first"], seen["count"], seen["cell"]) == (0, 64, 24), seen  # all of them, full size
            assert "the map shows every block" in seen["summary"]
        else:
            assert seen["count"] < num_blocks, seen  # zoomed to the region in use ...
            assert f"of {num_blocks:,}" in seen["summary"] and "the other" in seen["summary"]  # ... the rest summed up
        for t in threads:
            t.join()

        browser.wait_until(
            "return blockMap.counts[USED] === 0", what="blocks still shown as used after every stream ended"
        )
        browser.wait_until("return document.querySelectorAll('#requests tbody tr').length === 0")
        # The page's blocks are the allocator's, one by one (the engine is idle now).
        allocator = srv.manager.scheduler.allocator
        truth = [allocator.block_state(b) for b in range(num_blocks)]
        page = browser.js("return [...blockMap.states].map((s) => STATE_NAMES[s])")
        assert page == truth and "cached" in truth  # full blocks stay in the prefix cache
        header = browser.js(
            "return ['used', 'cached', 'free'].map((s) => +document.getElementById('stat-' + s).textContent)"
        )
        assert header == [truth.count("used"), truth.count("cached"), truth.count("free")]
        # Drawing stays cheap: the whole map is drawn when it zooms, otherwise a frame redraws only the
        # cells that changed (a few: no event here changes 100 blocks).
        drawn = browser.js("return blockMap.drawn")
        assert drawn["full"] <= 3 and drawn["partial"] > 0, drawn
        assert drawn["cells"] <= num_blocks * drawn["full"] + 100 * drawn["partial"], drawn
        if num_blocks == 8000:
            check_a_full_cache_zooms_to_the_used_blocks(browser)

        # The charts have axes with units, and the step caption agrees with the header's counts.
        browser.js("view.dirty = true")
        axes = browser.wait_until(
            "return chartAxes.timeline && chartAxes.timeline.step && chartAxes['hist-tpot'].ms && chartAxes"
        )
        assert {a: axes["timeline"][a]["unit"] for a in axes["timeline"]} == {
            "tokens": "tokens",
            "ms": "ms",
            "seqs": "seqs",
            "step": "step",
        }
        assert all(len(axes["timeline"][a]["ticks"]) >= 2 for a in ("tokens", "ms", "seqs"))
        assert axes["timeline"]["step"]["ticks"]  # 200+ steps: a labelled tick every 50
        for hist in ("hist-ttft", "hist-tpot"):
            assert axes[hist]["ms"]["unit"] == "ms" and len(axes[hist]["ms"]["ticks"]) >= 2
            assert axes[hist]["requests"]["unit"] == "requests"
        caption = browser.js("return document.getElementById('timeline-info').textContent")
        match = re.match(r"step (\d+): (\d+) seqs ran \((\d+) finished in it\), (\d+) running after it", caption)
        assert match, caption
        step, running = browser.js(
            "return ['stat-step', 'stat-running'].map((id) => +document.getElementById(id).textContent)"
        )
        assert (int(match[1]), int(match[4])) == (step, running) == (srv.manager.stats()["num_steps"], 0)

        # The playground streams through /v1 and learns its engine request id (to light up its blocks).
        browser.js("document.getElementById('play-max').value = 40; document.getElementById('play-temp').value = 0;")
        browser.driver.find_element("id", "play-send").click()
        browser.wait_until("return view.mine !== null && !document.getElementById('play-send').disabled")
        assert browser.js("return document.getElementById('play-out').textContent.length") > 0
        browser.wait_until("return blockMap.counts[USED] === 0 && blockMap.mine.size === 0")
        assert browser.console_errors() == []
    finally:
        srv.stop()


def check_a_full_cache_zooms_to_the_used_blocks(browser):
    """Once cached prefixes fill the cache, not every block that is not free fits on the map at a
    legible size: it zooms to the ones running requests hold. (The layout on made-up states.)"""
    layout, summary = browser.js(
        "const saved = blockMap.states;"
        "blockMap.states = new Uint8Array(saved.length).fill(CACHED); blockMap.states[5000] = blockMap.states[5100] = USED;"
        "blockMap.layout = null; drawBlockMap(); const out = [blockMap.layout, describeMap()];"
        "blockMap.states = saved; blockMap.layout = null; view.dirty = true; return out;"
    )
    assert layout["first"] <= 5000 and 5100 < layout["first"] + layout["count"] < 8000, layout
    assert layout["cell"] >= LEGIBLE_PX, layout
    assert re.search(r"the other [\d,]+: 0 used · [\d,]+ cached · 0 free", summary), summary


def test_page_asks_for_the_api_key_and_uses_it(browser, tiny_checkpoint):
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), port=0, api_key="sesame")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        browser.driver.get(f"http://127.0.0.1:{srv.server_address[1]}/")
        browser.wait_until("return !document.getElementById('key-form').hidden", what="no API key prompt")
        assert browser.js("return blockMap.states.length") == 0
        browser.driver.find_element("id", "key-input").send_keys("sesame\n")
        browser.wait_until("return blockMap.states.length === 64")
        assert browser.js("return document.getElementById('status').dataset.status") == "live"
    finally:
        srv.stop()


def test_tokens_per_second_reflect_running_requests_from_the_first_second(browser, tiny_checkpoint):
    """16 streams start; within a second of the first steps the header's tok/s is what the steps
    produced (not 0 while the rate's window fills), and it falls to 0 once the engine is idle."""
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=256, max_num_seqs=16), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        browser.driver.get(f"http://127.0.0.1:{port}/")
        browser.wait_until("return blockMap.layout !== null")
        threads = [threading.Thread(target=stream, args=(port, 400)) for _ in range(16)]
        for t in threads:
            t.start()
        browser.wait_until("return view.sampled.length > 0", what="no step reached the page")
        time.sleep(0.6)  # well inside the rate's 2 s window
        shown, tokens, span = browser.js(
            "updateRate(); const s = view.sampled;"
            "return [+document.getElementById('stat-tps').textContent, s.reduce((a, x) => a + x[3], 0),"
            "        s[s.length - 1][2] - s[0][1]]"
        )
        assert tokens > 0 and shown >= 0.6 * tokens / span, (shown, tokens, span)  # the steps' own rate
        for t in threads:
            t.join()
        browser.wait_until("return document.getElementById('stat-tps').textContent === '0'", what="tok/s after idle")
    finally:
        srv.stop()
