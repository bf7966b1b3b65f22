"""The docs read well and render: the README stays a front page (under 170 lines, no prose paragraph over 6
lines, the detail in docs/), every table has as many cells as its header, every image a page names is there,
the engine chapters of the course each embed a figure and the core ones a reading map whose anchors point at
their functions' `def` lines. Each test lists every broken item at once, with file and line."""

from __future__ import annotations

import re
from functools import cache

import pytest
from markdown_files import ALL_MARKDOWN, README, ROOT, line_at, paragraphs, rel


README_MAX_LINES = 170
MAX_PARAGRAPH_LINES = 6  # the README's prose paragraphs: a newcomer reads them, not skims them


def test_readme_stays_short():
    count = len(README.read_text(encoding="utf-8").splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines, more than {README_MAX_LINES}: keep one headline per topic there "
        "and move the detail to docs/ (performance.md, reliability.md, architecture.md), linking to it"
    )


def prose_paragraphs(markdown: str) -> list[tuple[int, list[str]]]:
    """(first line, lines) of each paragraph of prose: outside code blocks, tables, headings and lists."""
    paragraphs, current, start, fenced = [], [], 0, False
    for number, line in enumerate(markdown.splitlines() + [""], 1):
        if line.startswith("```"):
            fenced = not fenced
        prose = not fenced and line.strip() and not line.startswith(("#", "|", "```", "![")) and not (
            re.match(r"\s*([-*]|\d+\.) ", line) or (current == [] and line.startswith(" "))
        )
        if prose and not (current and re.match(r"\s*([-*]|\d+\.) ", current[0])):
            start = start if current else number
            current.append(line)
        else:
            if current:
                paragraphs.append((start, current))
            current = []
    return paragraphs


def test_readme_paragraphs_are_short():
    long = [f"README.md:{start}: {len(lines)} lines" for start, lines in prose_paragraphs(README.read_text())
            if len(lines) > MAX_PARAGRAPH_LINES]
    assert not long, "prose paragraphs over 6 lines; split them or move the detail to docs/:\n" + "\n".join(long)


def test_tables_have_as_many_cells_as_their_header():
    """A row with more or fewer cells than the header renders wrongly (GitHub drops the extra ones)."""
    wrong = []
    for path in ALL_MARKDOWN:
        fenced, header = False, None
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            if fenced or not line.startswith("|"):
                header = None
                continue
            cells = len(re.findall(r"(?<!\\)\|", line.replace("`|`", ""))) - 1
            if header is None:
                header = cells
            elif cells != header:
                wrong.append(f"{path.relative_to(ROOT)}:{number}: {cells} cells, the header has {header}")
    assert not wrong, "tables whose rows do not match their header:\n" + "\n".join(wrong)


IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?")
# Stages that show the engine's own state: each chapter embeds a figure drawn from it (tutorials/figures/draw.py).
FIGURE_STAGES = ["07", "08", "09", "10", "11", "12", "16"]


def test_every_image_a_chapter_names_exists():
    """Each `![...](path)` in the docs and tutorials names a non-empty SVG or PNG that is there."""
    broken, seen = [], 0
    for md in ALL_MARKDOWN:
        for start, text in paragraphs(md):
            for m in IMAGE.finditer(text):
                image, number = m.group(1), line_at(start, text, m.start())
                if "://" in image:
                    continue
                seen += 1
                path = (md.parent / image).resolve()
                if not path.is_file() or path.stat().st_size == 0:
                    broken.append(f"{rel(md)}:{number}: {image} is missing or empty")
                elif path.suffix == ".svg" and not path.read_text(encoding="utf-8").lstrip().startswith("<svg"):
                    broken.append(f"{rel(md)}:{number}: {image} is no SVG")
    assert seen, "no image found: the pattern is broken"
    assert not broken, "images the docs name that are not there:\n" + "\n".join(broken)


@pytest.mark.parametrize("stage", FIGURE_STAGES)
def test_engine_chapters_have_a_figure(stage):
    (chapter,) = (ROOT / "tutorials").glob(f"{stage}_*.md")
    images = IMAGE.findall(chapter.read_text(encoding="utf-8"))
    assert any(i.startswith("figures/") for i in images), (
        f"{rel(chapter)} embeds no figure from tutorials/figures/ (python tutorials/figures/draw.py draws them)"
    )


@cache
def reading_maps():
    """scripts/reading_maps.py, the check and its fixer."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("reading_maps", ROOT / "scripts" / "reading_maps.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reading_maps"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_reading_map_anchors_point_at_their_def():
    """`[`Class.method`](../minfer/x.py#L48)`: line 48 of x.py must be that method's `def` line. Code
    moves under the names; `python scripts/reading_maps.py --fix` re-anchors every map at once."""
    anchors = reading_maps().find_anchors()
    assert len(anchors) > 50, f"only {len(anchors)} reading-map anchors found: the pattern is broken"
    stale = [f"{a.where()}: line {a.line}, its def is at line {a.found}" for a in anchors if a.found not in (None, a.line)]
    missing = [f"{a.where()}: {rel(a.target)} defines no {a.name}" for a in anchors if a.found is None]
    assert not stale, (
        f"{len(stale)} reading-map anchor(s) no longer point at their def; run `python scripts/reading_maps.py "
        "--fix` to re-anchor them:\n" + "\n".join(stale)
    )
    assert not missing, "reading maps name functions that are gone (edit these chapters):\n" + "\n".join(missing)


@pytest.mark.parametrize("stage", ["03", "07", "08", "09", "10", "11", "12", "16"])
def test_core_chapters_have_a_reading_map(stage):
    (chapter,) = (ROOT / "tutorials").glob(f"{stage}_*.md")
    anchors = [a for a in reading_maps().find_anchors([chapter])]
    assert "## Reading map" in chapter.read_text(encoding="utf-8") and len(anchors) >= 3, (
        f"{rel(chapter)} has no reading map (a `## Reading map` of anchored functions, in reading order)"
    )
