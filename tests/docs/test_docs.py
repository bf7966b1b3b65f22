"""The prose stays true to the tree: README.md, docs/*.md, tutorials/*.md and tests/README.md name files,
folders, modules, anchors and `Class.method`s, and each of them must exist.

- every relative link resolves to a file or folder, and a `#anchor` into a markdown file to one of
  its headings (GitHub's slugs); a link whose text is a file's path (`[scoring/logprobs.py](...)`) links to
  that file;
- every `minfer/...` path and every dotted `minfer.x.y` module name exists, and every `tests/...` path;
- every backticked `Name.attr` in docs/ and tutorials/ whose Name is a class defined in minfer/
  names something that class (or a minfer class it derives from) defines;
- the `python bench.py` lines in docs/ use flags bench.py accepts (test_readme checks the README's).

How the docs read and render (the README's length, tables, figures, reading maps): test_doc_layout.py.
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
from markdown_files import (
    ALL_MARKDOWN, DOCS, README, ROOT, TESTS_README, TUTORIALS, anchors, code_spans, github_slug, line_at, lines_of,
    links, paragraphs, rel,
)

PACKAGE = ROOT / "minfer"

# A path into the package, or a dotted module name: not part of a longer word, path or URL.
MINFER_PATH = re.compile(r"(?<![\w/.-])minfer/[\w./-]*")
MINFER_MODULE = re.compile(r"(?<![\w/.-])minfer(?:\.[A-Za-z_]\w*)+")
TESTS_PATH = re.compile(r"(?<![\w/.-])tests/[\w./-]*")  # a test file or folder: tests move between folders
BARE_FILE = re.compile(r"^[\w.-]+\.(?:py|md|js|css|html)$")  # `kv_cache.py`: a file name without its folder
CLASS_ATTR = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)")


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


# A link whose text is a file name or the tail of a path: `[scoring/logprobs.py](../minfer/scoring/logprobs.py)`.
PATH_LINK = re.compile(r"\[`?([\w.-]+(?:/[\w.-]+)*\.(?:py|md|sh|js|css|html|json|txt))`?\]\(\s*<?([^)\s>#]+)")


def test_link_texts_name_their_targets():
    """The path a link shows is the path it opens: after a file moves, the old name must not stay as the text."""
    wrong, seen = [], 0
    for md in ALL_MARKDOWN:
        for start, text in paragraphs(md):
            for m in PATH_LINK.finditer(text):
                shown, target = m.groups()
                if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                    continue
                seen += 1
                dest = (md.parent / target).resolve()
                if not dest.as_posix().endswith("/" + shown.removeprefix("./")):
                    wrong.append(f"{rel(md)}:{line_at(start, text, m.start())}: [{shown}] links to {target}")
    assert seen > 100, f"only {seen} links showing a path: the pattern is broken"
    assert not wrong, f"{len(wrong)} link(s) whose text names another file:\n" + "\n".join(wrong)


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


@cache
def names_defined_in_minfer() -> frozenset[str]:
    """Every function, class, attribute and module-level name minfer's source defines."""
    names = set()
    for source in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return frozenset(names)


def test_architecture_names_table_names_minfer_code():
    """docs/architecture.md maps minfer's names to vLLM's: every name in its minfer column is defined in minfer/
    (a renamed class or function must not stay there; the vLLM column is not checked)."""
    rows, inside = [], False
    for _, line, fenced in lines_of(ROOT / "docs" / "architecture.md"):
        inside = not fenced and line.startswith("|") and (inside or line.startswith("| minfer | vLLM |"))
        if inside and line.startswith("| `"):
            rows.append(line)
    assert len(rows) > 20, "the names table of docs/architecture.md (| minfer | vLLM |) is not where it was"
    missing = []
    for line in rows:
        for span in re.findall(r"`([^`]+)`", line.split("|")[1]):
            name = span.removesuffix("()").split(".")[-1]
            if re.fullmatch(r"[A-Za-z_]\w*", name) and name not in names_defined_in_minfer():
                missing.append(f"docs/architecture.md: `{span}` ({line.split('|')[2].strip()[:40]}...)")
    assert not missing, "names the architecture page maps that minfer does not define:\n" + "\n".join(missing)


ENDPOINT = re.compile(r"(?:(GET|POST) )?(/(?:v1|health|metrics|version|generate|tokeni|detokeni|engine)[\w/{}.-]*|/)")


def test_endpoints_named_are_served():
    """`POST /tokenize`, `GET /health`, `/v1/chat/completions`: each endpoint the docs name in code is a route
    of the server (APIHandler.ROUTES), with the method they give it."""
    from minfer.server.endpoints import APIHandler

    wrong, seen = [], 0
    for md in ALL_MARKDOWN:
        for number, span in code_spans(md):
            m = ENDPOINT.fullmatch(span)
            if not m:
                continue
            seen += 1
            method, path = m.groups()
            route = APIHandler.ROUTES.get(path)
            if route is None:
                wrong.append(f"{rel(md)}:{number}: `{span}`: the server has no route {path}")
            elif method and route[0] != method:
                wrong.append(f"{rel(md)}:{number}: `{span}`: {path} answers {route[0]}, not {method}")
    assert seen > 30, f"only {seen} endpoints named: the pattern is broken"
    message = f"{len(wrong)} endpoint(s) named in the docs that the server does not serve so:\n"
    assert not wrong, message + "\n".join(wrong)


def test_minfer_variables_named_are_read():
    """Each MINFER_* variable the prose names is read: by minfer (an EnvVar of minfer/settings/, which `minfer settings`
    lists), or, for the course's and the tests' own, by tutorials/_common.py or a test."""
    tests = [path for path in (ROOT / "tests").rglob("*.py") if path.parent != ROOT / "tests" / "docs"]  # not these
    readers = [PACKAGE / "settings" / "__init__.py", ROOT / "tutorials" / "_common.py", *tests]
    read = {name for path in readers for name in re.findall(r"[\"'](MINFER_[A-Z_]+)[\"']", path.read_text())}
    assert {"MINFER_DEVICE", "MINFER_MODEL"} <= read, sorted(read)
    unread = [f"{rel(md)}:{number}: {name}" for md in ALL_MARKDOWN for number, line, _ in lines_of(md)
              for name in re.findall(r"\bMINFER_[A-Z_]*[A-Z]\b", line) if name not in read]
    assert not unread, "MINFER_ variables the docs name that nothing reads:\n" + "\n".join(unread)


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


def test_the_metrics_serving_md_lists_are_the_ones_metrics_renders():
    """docs/serving.md's Metrics section names every metric /metrics always renders, and nothing it does not."""
    from minfer.server.connections import ConnectionStats
    from minfer.server.metrics import Metrics
    from minfer.server.prometheus import connection_lines, render

    text = render(Metrics(), {"num_path_fallbacks": 0}) + connection_lines(ConnectionStats(1))
    rendered = set(re.findall(r"^# HELP (\w+)", text, re.M))
    section = (ROOT / "docs" / "serving.md").read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`((?:minfer|process)_\w+)`", section))
    assert listed == rendered, f"listed, not rendered: {sorted(listed - rendered)}; rendered, not listed: " \
        f"{sorted(rendered - listed)}"
