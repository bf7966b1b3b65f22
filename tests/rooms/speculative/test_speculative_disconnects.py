"""Speculating requests whose clients go away mid-stream: the server discards them between steps, and
every KV block comes back, including those that held proposals still being verified."""

import time

from serving import AUTH, call, metrics, open_stream, serving
from speculation_checks import SPEC, copy_prompts

from minfer import EngineConfig


def test_disconnected_speculating_streams_free_every_block(make_checkpoint):
    config = EngineConfig(model=str(make_checkpoint()), block_size=4, num_kv_blocks=400, **SPEC)
    with serving(config) as srv:
        port = srv.server_address[1]
        name = call(port, "GET", "/v1/models", headers=AUTH)[2]["data"][0]["id"]
        # Seeded, so each speculates whatever else runs; copy prompts, so proposals are found and kept.
        bodies = [
            {"model": name, "prompt": prompt, "max_tokens": 300, "temperature": 0.8, "seed": i, "ignore_eos": True}
            for i, prompt in enumerate(copy_prompts(8, 512, seed=5))
        ]
        before = metrics(port)
        socks = [open_stream(port, body) for body in bodies]
        while metrics(port)["minfer_spec_decode_num_drafts_total"] == before["minfer_spec_decode_num_drafts_total"]:
            time.sleep(0.02)  # until the streams are speculating
        for sock in socks:
            sock.close()
        closed = time.monotonic()
        while True:
            m = metrics(port)
            if m["minfer_kv_blocks_free"] == m["minfer_kv_blocks_total"] and m["minfer_requests_running"] == 0:
                break
            # Freed before the next step on a quiet machine; the bound only catches a leak.
            assert time.monotonic() - closed < 15.0, f"blocks still held 15 s after the disconnects: {m}"
            time.sleep(0.02)
        assert m["minfer_requests_waiting"] == 0
        assert m["minfer_requests_aborted_total"] - before["minfer_requests_aborted_total"] == len(bodies)
        assert m["minfer_spec_decode_num_draft_tokens_total"] > before["minfer_spec_decode_num_draft_tokens_total"]
        assert call(port, "GET", "/health", headers={})[0] == 200
    scheduler = srv.manager.scheduler  # the worker has stopped: safe to read from here
    scheduler.check_invariants()
    assert all(block.ref_count == 0 for block in scheduler.allocator.blocks)
