"""docs/sampling.md's table of sampling fields says what `SamplingParams` does: each field's default is the
dataclass's, and each numeric range (`≥ 1`, `(0, 1]`, `[-2, 2]`, `> 0`) is the one its check keeps: the ends
it includes are accepted, the values just past them refused. Fields the table lists are SamplingParams'."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from markdown_files import ROOT, lines_of

from minfer import SamplingParams

PAGE = ROOT / "docs" / "sampling.md"
DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}


def table() -> list[tuple[int, str, str, str]]:
    """(line, field, default, range) of every row of the table under "## The fields"."""
    rows, inside = [], False
    for number, line, fenced in lines_of(PAGE):
        if line.startswith("## "):
            inside = line.strip() == "## The fields"
        m = re.match(r"\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", line)
        if inside and not fenced and m:
            rows.append((number, m.group(1), m.group(2).strip(), m.group(3).strip()))
    return rows


ROWS = table()


def test_the_table_is_found():
    assert len(ROWS) >= 15, ROWS
    assert not [field for _, field, _, _ in ROWS if field not in DEFAULTS], "fields SamplingParams does not have"


def stated(default: str):
    word = default.split(" (")[0].strip()
    return {"none": None, "true": True, "false": False}.get(word, word)


@pytest.mark.parametrize("line, field, default", [(n, f, d) for n, f, d, _ in ROWS], ids=[r[1] for r in ROWS])
def test_default_is_sampling_params(line, field, default):
    want, have = stated(default), DEFAULTS[field]
    if isinstance(want, str):
        assert not isinstance(have, bool) and float(want) == have, f"sampling.md:{line}: {field} {default} vs {have}"
    else:
        assert have is want, f"sampling.md:{line}: {field}: the table says {default}, SamplingParams has {have!r}"


def accepts(field: str, value) -> bool:
    try:
        SamplingParams(**{field: value})
    except ValueError:
        return False
    return True


def cases(field: str, range_: str) -> list[tuple[float, bool]] | None:
    """(value, accepted) at and just past each end of a numeric range; None for a range of another kind."""
    step = 1 if type(DEFAULTS[field]) is int else 0.01
    interval = re.fullmatch(r"([\[(])(-?[\d.]+), (-?[\d.]+)([\])])", range_)
    if interval:
        opening, low, high, closing = interval.groups()
        low, high = float(low), float(high)
        return [(low, opening == "["), (high, closing == "]"), (low - step, False), (high + step, False)]
    at_least = re.fullmatch(r"≥ (-?\d+)(?:, or (-?\d+))?", range_)
    if at_least:
        low, also = int(at_least.group(1)), at_least.group(2)
        out = [(low, True), (low + 1, True)]
        return out + ([(int(also), True), (int(also) - 1, False)] if also else [(low - step, False)])
    above = re.fullmatch(r"> (-?[\d.]+)", range_)
    if above:
        return [(float(above.group(1)), False), (float(above.group(1)) + step, True)]
    return None


NUMERIC = [(n, f, r) for n, f, _, r in ROWS if cases(f, r)]


def test_numeric_ranges_are_found():
    assert len(NUMERIC) >= 8, NUMERIC


@pytest.mark.parametrize("line, field, range_", NUMERIC, ids=[r[1] for r in NUMERIC])
def test_range_is_the_check(line, field, range_):
    wrong = [f"{value} {'refused' if ok else 'accepted'}" for value, ok in cases(field, range_)
             if accepts(field, value) != ok]
    assert not wrong, f"sampling.md:{line}: {field} in {range_}, but: {', '.join(wrong)}"
