"""The prose stays true to the tree: README.md, docs/*.md, tutorials/*.md and tests/README.md name files,
folders, modules, anchors and `Class.method`s, and each of them must exist.

- every relative link resolves to a file or folder, and a `#anchor` into a markdown file to one of
  its headings (GitHub's slugs);
- every `minfer/...` path and every dotted `minfer.x.y` module name exists, and every `tests/...` path;
- every backticked `Name.attr` in docs/ and tutorials/ whose Name is a class defined in minfer/
  names something that class (or a minfer class it derives from) defines;
- the `python bench.py` lines in docs/ use flags bench.py accepts (test_readme checks the README's);
- the README stays a front page: under 170 lines, no prose paragraph over 6 lines, the detail in docs/;
- every table renders: each row has as many cells as its header.

Each test lists every broken item at once, with file and line.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "minfer"
README = ROOT / "README.md"
README_MAX_LINES = 170
MAX_PARAGRAPH_LINES = 6  # the README's prose paragraphs: a newcomer reads them, not skims them
DOCS = sorted((ROOT / "docs").glob("*.md"))
TUTORIALS = sorted((ROOT / "tutorials").glob("*.md"))
TESTS_README = ROOT / "tests" / "README.md"  # the map from tutorial stages to their tests
ALL_MARKDOWN = [README, *DOCS, *TUTORIALS, TESTS_README]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")
# A path into the package, or a dotted module name: not part of a longer word, path or URL.
MINFER_PATH = re.compile(r"(?<![\w/.-])minfer/[\w./-]*")
MINFER_MODULE = re.compile(r"(?<![\w/.-])minfer(?:\.[A-Za-z_]\w*)+")
TESTS_PATH = re.compile(r"(?<![\w/.-])tests/[\w./-]*")  # a test file or folder: tests move between folders
BARE_FILE = re.compile(r"^[\w.-]+\.(?:py|md|js|css|html)$")  # `kv_cache.py`: a file name without its folder
CLASS_ATTR = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)")


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


def test_markdown_files_are_found():
    assert README.exists() and DOCS and TUTORIALS and TESTS_README.exists(), (DOCS, TUTORIALS)


def test_relative_links_resolve():
    broken = []
    for md in ALL_MARKDOWN:
        for number, target in links(md):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
                continue  # http:, https:, mailto:...
            where = f"{rel(md)}:{number}: ({target})"
            file_part, _, anchor = target.partition("#")
            dest = (md.parent / file_part).resolve() if file_part else md
            if not dest.exists():
                broken.append(f"{where}: {rel(dest) if dest.is_relative_to(ROOT) else dest} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: {rel(dest)} has no heading with the anchor #{anchor}")
    assert not broken, f"{len(broken)} broken link(s):\n" + "\n".join(broken)


def module_path(parts: list[str]) -> Path | None:
    """The file or package folder a dotted name under minfer/ names, or None."""
    base = ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if base.is_dir():
        return base
    return None


def top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (for `minfer.module.name`)."""
    if path.is_dir():
        path = path / "__init__.py"
        if not path.is_file():
            return set()
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def dotted_name_exists(name: str) -> bool:
    """`minfer.a.b` is a module or package, or `minfer.a.f` something module a defines."""
    parts = name.split(".")
    if module_path(parts):
        return True
    parent = module_path(parts[:-1])
    return parent is not None and parts[-1] in top_level_names(parent)


def test_minfer_paths_and_modules_exist():
    missing = []
    for md in ALL_MARKDOWN:
        for number, line, _ in lines_of(md):
            for m in [*MINFER_PATH.finditer(line), *TESTS_PATH.finditer(line)]:
                path = m.group(0).rstrip(".,;:")
                if not (ROOT / path).exists():
                    missing.append(f"{rel(md)}:{number}: {path} does not exist")
            for m in MINFER_MODULE.finditer(line):
                if not dotted_name_exists(m.group(0)):
                    missing.append(f"{rel(md)}:{number}: {m.group(0)} is no module, nor a name in one")
    assert not missing, f"{len(missing)} path(s) or module(s) named in the docs do not exist:\n" + "\n".join(missing)


@cache
def repo_file_names() -> frozenset[str]:
    """The name of every file in the repository's own folders (not .git, caches or virtual environments)."""
    skip = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache", "build", "dist"}
    names = set()
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in skip and not d.endswith(".egg-info")]
        names.update(files)
    return frozenset(names)


def test_file_names_exist():
    """A file named without its folder (`kv_cache.py`, `bench.py`) is still some file of the repository:
    a renamed module's old name must not linger in the prose."""
    names = repo_file_names()
    missing = []
    for md in ALL_MARKDOWN:
        for number, span in code_spans(md):
            if BARE_FILE.match(span) and "NN_" not in span and span not in names:
                missing.append(f"{rel(md)}:{number}: `{span}` is no file of the repository")
    assert not missing, f"{len(missing)} file name(s) in the docs match no file:\n" + "\n".join(missing)


@cache
def class_index() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Every class defined anywhere in minfer/ (nested ones too), by name, with its file."""
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for source in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((rel(source), node))
    return classes


def minfer_classes() -> dict[str, list[ast.ClassDef]]:
    return {name: [node for _, node in found] for name, found in class_index().items()}


def _targets(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)


def defined_in(cls: ast.ClassDef) -> set[str]:
    """What a class defines: methods, nested classes, class attributes and dataclass fields, and
    every `self.x` its methods assign."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(_targets(target))
        elif isinstance(node, ast.AnnAssign):
            names.update(_targets(node.target))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, (ast.Name, ast.Attribute))]


def class_has(name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Some minfer class called `name`, or a minfer class it derives from, defines `attr`."""
    for cls in minfer_classes().get(name, []):
        if attr in defined_in(cls):
            return True
        for base in base_names(cls):
            if base in minfer_classes() and base not in seen and class_has(base, attr, seen | {name}):
                return True
    return False


def external_bases(name: str) -> list[str]:
    """The bases of the classes called `name` (and of their minfer bases) that minfer does not define."""
    out, todo, seen = [], [name], set()
    while todo:
        current = todo.pop()
        seen.add(current)
        for cls in minfer_classes().get(current, []):
            for base in base_names(cls):
                if base in minfer_classes():
                    if base not in seen:
                        todo.append(base)
                elif base not in ("object", "Protocol", "Generic"):
                    out.append(base)
    return out


def inherited_from_library(name: str, attr: str) -> bool:
    """`attr` comes from a standard-library or torch base class (`MinferServer.serve_forever` from
    ThreadingHTTPServer, `GPT2.to` from nn.Module): looked up in the libraries minfer's classes derive from."""
    import enum
    import http.server
    import socketserver
    import threading

    libraries = [http.server, socketserver, threading, enum]
    try:
        import torch.nn

        libraries.append(torch.nn)
    except ImportError:
        pass
    for base in external_bases(name):
        for library in libraries:
            if hasattr(getattr(library, base, None), attr):
                return True
    return False


def test_class_attribute_references_exist():
    """`OnlineScheduler.step`, `BlockAllocator.allocate`...: the class is found in minfer's source with ast
    and must define the attribute. Backticked `Name.attr` whose Name is no minfer class are not checked."""
    classes = minfer_classes()
    assert "OnlineScheduler" in classes and "BlockAllocator" in classes, sorted(classes)
    missing, checked = [], 0
    for md in [*DOCS, *TUTORIALS]:
        for number, span in code_spans(md):
            for m in CLASS_ATTR.finditer(span):
                name, attr = m.groups()
                if name not in classes:
                    continue
                checked += 1
                if not class_has(name, attr) and not inherited_from_library(name, attr):
                    files = ", ".join(sorted({path for path, _ in class_index()[name]}))
                    missing.append(f"{rel(md)}:{number}: `{m.group(0)}`: class {name} ({files}) has no {attr}")
    assert checked, "no `Class.attr` reference found: the pattern or the class index is broken"
    assert not missing, f"{len(missing)} `Class.attr` reference(s) name nothing:\n" + "\n".join(missing)


def bench_lines_in_docs() -> list[tuple[str, str]]:
    out = []
    for md in DOCS:
        for number, line, fenced in lines_of(md):
            if fenced and line.strip().startswith("python bench.py"):
                out.append((f"{rel(md)}:{number}", line.strip()))
    return out


def test_bench_commands_in_docs_parse(monkeypatch):
    """docs/performance.md's reproduce lines are benchmarks (minutes each): check that bench.py takes their flags."""
    lines = bench_lines_in_docs()
    if not lines:
        pytest.skip("no `python bench.py` line in docs/")
    monkeypatch.syspath_prepend(str(ROOT))
    try:
        from minfer.bench.cli import parse_args  # bench.py's code
    except ImportError:
        from bench import parse_args

    rejected = []
    for where, line in lines:
        try:
            parse_args(shlex.split(line)[2:])  # a $VARIABLE stays as it is: any string will do for a path
        except SystemExit:
            rejected.append(f"{where}: {line}")
    assert not rejected, "bench.py rejects these lines' flags:\n" + "\n".join(rejected)


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


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("The life of a request", "the-life-of-a-request"),
        ("1. The handler thread: HTTP in", "1-the-handler-thread-http-in"),
        ("The allocator: `BlockAllocator` in `minfer/kv_cache.py`", "the-allocator-blockallocator-in-minferkv_cachepy"),
        ("Chatting with Qwen3 or Llama", "chatting-with-qwen3-or-llama"),
        ("Batch-1 decode — against the floor", "batch-1-decode--against-the-floor"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


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
