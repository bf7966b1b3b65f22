"""The markdown files the docs tests read (README.md, docs/, tutorials/, tests/README.md), and how they read
them: lines outside fenced code, paragraphs, inline code spans, links, and the anchors GitHub gives headings."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
TUTORIALS = sorted((ROOT / "tutorials").glob("*.md"))
TESTS_README = ROOT / "tests" / "README.md"  # the map from tutorial stages to their tests
ALL_MARKDOWN = [README, *DOCS, *TUTORIALS, TESTS_README]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def lines_of(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a fenced code block) for every line of a markdown file."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            out.append((number, line, True))
        else:
            out.append((number, line, fenced))
    return out


def paragraphs(path: Path):
    """(first line number, text) of each paragraph outside fenced blocks: inline code and links may
    run over a line break, never over a blank line."""
    block, start = [], 0
    for number, line, fenced in [*lines_of(path), (0, "", True)]:
        if fenced or not line.strip():
            if block:
                yield start, "\n".join(block)
            block = []
        else:
            if not block:
                start = number
            block.append(line)


def line_at(start: int, text: str, offset: int) -> int:
    return start + text.count("\n", 0, offset)


def code_spans(path: Path):
    """(line number, text) of every inline code span outside fenced blocks, a line break read as a space."""
    for start, text in paragraphs(path):
        for m in INLINE_CODE.finditer(text):
            yield line_at(start, text, m.start()), m.group(2).replace("\n", " ").strip()


def links(path: Path):
    """(line number, target) of every link and image outside code."""
    for start, text in paragraphs(path):
        prose = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # a link in backticks is none
        for m in LINK.finditer(prose):
            yield line_at(start, prose, m.start()), m.group(1)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lowercased, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _, as GitHub does
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor a markdown file has: its headings' slugs (repeats numbered -1, -2...) and <a name>s."""
    seen: dict[str, int] = {}
    found = set()
    for _, line, fenced in lines_of(path):
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        if m := HEADING.match(line):
            slug = github_slug(m.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)
