"""The server's replies stay what they were: the SSE and JSON of fixed requests (a streamed chat, a
streamed completion with logprobs and n = 2, batched prompts scored with echo, bad inputs) against the
fixtures recorded before the server's request path was rewritten (tests/golden_outputs.py), ids and
timestamps masked. Logprobs compare within 1e-4."""

import json
import math

import pytest
from golden_outputs import GOLDEN, REQUESTS, replies, write_checkpoint


def same(got, want, where="") -> list[str]:
    if isinstance(want, float) and isinstance(got, (int, float)):
        return [] if math.isclose(got, want, abs_tol=1e-4) else [f"{where}: {got} != {want}"]
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [d for k in want for d in same(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in same(g, w, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return replies(write_checkpoint(tmp_path_factory.mktemp("golden")))


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_reply_equals_the_recorded_one(current, name):
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    differences = same(current[name], want, name)
    assert not differences, "\n".join(differences[:10])
