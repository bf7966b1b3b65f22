"""The default path is the plain core: what one completion on minfer-tiny really runs.

scripts/core_path.py serves minfer-tiny in-process with a profiler on every thread and records every
minfer function two completions run. docs/life_of_a_request.md names those functions in the order
they run: every name it writes with `()` must be one of them. And a request that asks for no feature
runs no feature room's code, but for the CPU platform's (thread sharing, packed linears).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import core_path  # noqa: E402

LIFE = ROOT / "docs" / "life_of_a_request.md"
CALLED = re.compile(r"`((?:[A-Za-z_]\w*\.)?[A-Za-z_]\w*)\(\)`")
IDLE_ROOMS = ("scoring", "parallel_sampling", "speculative", "compiled", "quantization")


@pytest.fixture(scope="module")
def recorder():
    return core_path.record("minfer-tiny")


def test_life_of_a_request_names_functions_that_ran(recorder):
    ran = {code.co_qualname for code in recorder.codes} | {code.co_name for code in recorder.codes}
    named = [(n, m.group(1)) for n, line in enumerate(LIFE.read_text().splitlines(), 1) for m in CALLED.finditer(line)]
    assert len(named) >= 60, f"the page names only {len(named)} functions that run"
    missing = [f"line {n}: {name}()" for n, name in named if name not in ran]
    assert not missing, "docs/life_of_a_request.md names functions a completion does not run:\n" + "\n".join(missing)


def test_page_follows_the_order_they_ran(recorder):
    """Names appear in the order of their first call, one thread at a time (the handler's early steps,
    the worker's, then the handler's way out), allowing a name to be mentioned again out of turn."""
    first = {}
    for i, (_, code) in enumerate(recorder.order):
        first.setdefault(code.co_qualname, i)
    worker = [m.group(1) for m in CALLED.finditer(LIFE.read_text().split("## 3.")[1].split("## 4.")[0])]
    positions = [first[name] for name in worker if name in first]
    assert positions == sorted(positions) or sum(a > b for a, b in zip(positions, positions[1:])) <= 3, worker


def test_a_plain_request_runs_no_feature_room(recorder):
    rooms = sorted({
        Path(code.co_filename).relative_to(ROOT).as_posix()
        for code in recorder.codes
        if Path(code.co_filename).relative_to(ROOT).parts[1] in IDLE_ROOMS
    })
    assert rooms == [], f"a completion that asks for no feature ran feature code in {rooms}"
