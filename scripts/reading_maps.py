"""Keep the tutorials' reading maps pointing at the right lines.

A reading map links a function by name to the line of its `def` (or `class`) in minfer's source:

    [`ContinuousBatcher.schedule`](../minfer/engine/continuous_batcher.py#L48)

Code moves; the names stay. This script finds every such link in tutorials/*.md and docs/*.md, looks
the name up in the file with `ast`, and reports (or, with --fix, rewrites) every anchor that no longer
points at its `def` line:

    python scripts/reading_maps.py          # list the stale anchors; exit 1 if there are any
    python scripts/reading_maps.py --fix    # rewrite them to the current lines

A name that no longer exists in its file cannot be fixed here: the chapter must change. tests/docs/test_doc_layout.py
runs the check.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# [`Name.attr`](../minfer/path.py#L123), the backticks optional
ANCHOR = re.compile(r"\[`?(?P<name>[A-Za-z_][\w.]*)`?\]\((?P<path>(?:\.\./)+minfer/[\w/]+\.py)#L(?P<line>\d+)\)")


@dataclass
class Anchor:
    markdown: Path
    line_number: int  # in the markdown file
    name: str  # `Class.method`, `Class` or `function`
    target: Path  # the source file
    line: int  # the anchored line
    found: int | None  # the line of the name's def/class now, None if the file has no such name

    def where(self) -> str:
        return f"{self.markdown.relative_to(ROOT)}:{self.line_number}: {self.name}"


def definition_lines(source: Path) -> dict[str, int]:
    """Every top-level function and class of a file, and every method as `Class.method`, with the line
    of its `def` or `class` keyword (after any decorators)."""
    lines = {}
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines[node.name] = node.lineno
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    lines[f"{node.name}.{item.name}"] = item.lineno
    return lines


def markdown_files() -> list[Path]:
    return sorted([*(ROOT / "tutorials").glob("*.md"), *(ROOT / "docs").glob("*.md")])


def find_anchors(files: list[Path] | None = None) -> list[Anchor]:
    anchors, cache = [], {}
    for md in files or markdown_files():
        for number, text in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            for m in ANCHOR.finditer(text):
                target = (md.parent / m["path"]).resolve()
                if target not in cache:
                    cache[target] = definition_lines(target) if target.is_file() else {}
                found = cache[target].get(m["name"])
                anchors.append(Anchor(md, number, m["name"], target, int(m["line"]), found))
    return anchors


def fix(anchors: list[Anchor]) -> int:
    """Rewrite each stale anchor to its name's current line; returns how many were rewritten."""
    stale = [a for a in anchors if a.found is not None and a.found != a.line]
    for md in {a.markdown for a in stale}:
        lines = md.read_text(encoding="utf-8").splitlines(keepends=True)
        for a in (a for a in stale if a.markdown == md):
            old = lines[a.line_number - 1]
            pattern = re.compile(rf"(\[`?{re.escape(a.name)}`?\]\([^)#]+#L){a.line}\)")
            lines[a.line_number - 1] = pattern.sub(rf"\g<1>{a.found})", old)
        md.write_text("".join(lines), encoding="utf-8")
    return len(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="rewrite stale anchors to the current lines")
    args = parser.parse_args(argv)
    anchors = find_anchors()
    missing = [a for a in anchors if a.found is None]
    stale = [a for a in anchors if a.found is not None and a.found != a.line]
    if args.fix and stale:
        print(f"rewrote {fix(anchors)} anchor(s)")
        stale = []
    for a in stale:
        print(f"{a.where()}: anchored at line {a.line}, its def is at line {a.found}")
    for a in missing:
        print(f"{a.where()}: {a.target.relative_to(ROOT)} defines no {a.name}: edit the chapter")
    print(f"{len(anchors)} reading-map anchors, {len(stale)} stale, {len(missing)} naming nothing")
    return 1 if stale or missing else 0


if __name__ == "__main__":
    sys.exit(main())
