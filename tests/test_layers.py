"""The floor plan holds: every import in minfer/ runs down the layers that docs/architecture.md draws.

Imports are read from the source with ast, all of them: module level, inside functions and
under TYPE_CHECKING. A module may import its own package and any layer below its own; a
layer's peers (attention and text; bench and stress) do not import each other.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minfer"

# Bottom up. A module's layer is the first entry that its dotted name starts with.
LAYERS = [
    ("base", 0, ("minfer.errors", "minfer.host_to_device", "minfer.step_parts", "minfer.version")),
    ("attention", 1, ("minfer.attention",)),
    ("text", 1, ("minfer.text",)),
    ("cpu", 2, ("minfer.cpu",)),
    ("quantization", 3, ("minfer.quantization",)),
    ("models", 4, ("minfer.models",)),
    ("checkpoints", 5, ("minfer.checkpoints",)),
    ("engine", 6, ("minfer.engine", "minfer.scoring", "minfer.speculative", "minfer.compiled", "minfer.assembly")),
    ("server", 7, ("minfer.server",)),
    ("bench", 8, ("minfer.bench",)),
    ("stress", 8, ("minfer.stress",)),
    # What users run: the package's names, the `minfer` command and the old `python -m` entry points.
    ("entry", 9, ("minfer.__init__", "minfer.__main__", "minfer.cli", "minfer.serve", "minfer.generate", "minfer.quantize",
                  "minfer.random_model")),
]
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts)


def layer_of(module: str) -> tuple[str, int]:
    if module == "minfer":
        module = "minfer.__init__"
    for name, rank, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name, rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def imported_modules(source: str, own: str, is_package: bool, modules: set[str]) -> list[tuple[int, str]]:
    """(line, minfer module) for every import of a minfer module in `source`, the code of module `own`."""
    package = own if is_package else own.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "minfer"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "minfer":
                continue
            for alias in node.names:  # `from . import live_view` imports a module
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in modules else target))
    return found


def imports_of(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    return imported_modules(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py", modules)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_module_is_in_a_layer():
    for module in all_modules():
        layer_of(module)


def test_imports_run_down_the_layers():
    modules = all_modules()
    wrong = []
    for module, path in sorted(modules.items()):
        name, rank = layer_of(module)
        for line, target in imports_of(path, set(modules)):
            if target == "minfer":
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports the minfer package itself")
                continue
            target_name, target_rank = layer_of(target)
            if target_name != name and target_rank >= rank:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {target} ({target_name})")
    assert not wrong, "imports against the layers' directions:\n" + "\n".join(wrong)


def test_no_module_is_too_long():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines hold two concepts; split them:\n" + "\n".join(long)


def test_the_checker_sees_what_it_must():
    """Upward imports inside a function, under TYPE_CHECKING and of a sibling module are all found."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..assembly import llm\n"
        "def f():\n    from ..server.serve import main\n"
        "from .. import step_parts\n"
    )
    modules = set(all_modules())
    targets = sorted(t for _, t in imported_modules(source, "minfer.attention.paged", False, modules))
    assert targets == ["minfer.assembly.llm", "minfer.server.serve", "minfer.step_parts"]
